"""The ADS server's protocol, driven by a scripted client standing in for Envoy.

Each test walks the exchange step by step and asserts what the server answers next, so
ordering (make before break), ACK/NACK bookkeeping and the bounds are checked without
timing anything. The real Envoy is in test_xds_envoy.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2
from google.rpc import status_pb2

from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    Snapshot,
)
from infergate.gateway.xds import BIND_ADDRESS_KEY, AdsServer
from tests.support.xds_harness import (
    assignment,
    eds_cluster,
    http_listener,
    route_config,
    snapshot,
)

NODE = "ns/gw"
_MESSAGES: dict[str, Any] = {
    CLUSTER_TYPE: cluster_pb2.Cluster,
    ENDPOINT_TYPE: endpoint_pb2.ClusterLoadAssignment,
    LISTENER_TYPE: listener_pb2.Listener,
    ROUTE_TYPE: route_pb2.RouteConfiguration,
}


def config(route_to: str, clusters: tuple[str, ...] = ("a", "b"), port: int = 8080) -> Snapshot:
    return snapshot(
        listeners=[http_listener("http", port, "routes")],
        routes=[route_config("routes", route_to)],
        clusters=[eds_cluster(name) for name in clusters],
        assignments=[assignment(name, [("10.0.0.1", 80 + i)]) for i, name in enumerate(clusters)],
    )


def names(response: Any) -> list[str]:
    """The resource names in a response, decoded."""
    out = []
    for packed in response.resources:
        message = _MESSAGES[response.type_url]()
        packed.Unpack(message)
        out.append(message.cluster_name if response.type_url == ENDPOINT_TYPE else message.name)
    return out


def unpack(response: Any) -> list[Any]:
    out = []
    for packed in response.resources:
        message = _MESSAGES[response.type_url]()
        packed.Unpack(message)
        out.append(message)
    return out


class FakeEnvoy:
    """One ADS stream; ``send`` a request, ``recv`` the server's next response."""

    def __init__(self, port: int, node_id: str = NODE, metadata: dict[str, str] | None = None):
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.node_id = node_id
        self.metadata = metadata or {}
        self.requests: asyncio.Queue[Any] = asyncio.Queue()
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(
            self.channel
        ).StreamAggregatedResources(self._requests())
        self.first = True
        self.last: dict[str, Any] = {}
        self.names: dict[str, tuple[str, ...]] = {}

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            request = await self.requests.get()
            if request is None:
                return
            yield request

    def send(
        self,
        type_url: str,
        names: tuple[str, ...] = (),
        *,
        version: str = "",
        nonce: str = "",
        error: str | None = None,
    ) -> None:
        request = discovery_pb2.DiscoveryRequest(
            type_url=type_url,
            resource_names=list(names),
            version_info=version,
            response_nonce=nonce,
        )
        self.names[type_url] = names
        if self.first:
            request.node.id = self.node_id
            metadata = struct_pb2.Struct()
            metadata.update(self.metadata)
            request.node.metadata.CopyFrom(metadata)
            self.first = False
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        self.requests.put_nowait(request)

    async def recv(self) -> Any:
        response = await asyncio.wait_for(self.call.read(), 10)
        assert response is not grpc.aio.EOF, "the server closed the stream"
        self.last[response.type_url] = response
        return response

    def ack(self, response: Any, names: tuple[str, ...] | None = None) -> None:
        """ACK ``response``, asking for ``names`` (default: the names asked for last)."""
        if names is None:
            names = self.names.get(response.type_url, ())
        self.send(response.type_url, names, version=response.version_info, nonce=response.nonce)

    async def ack_until(self, type_url: str) -> Any:
        """ACK every response until one of ``type_url`` arrives; return it (unacked)."""
        while True:
            response = await self.recv()
            if response.type_url == type_url:
                return response
            self.ack(response)

    def nack(self, response: Any, error: str, previous: str = "") -> None:
        names = self.names.get(response.type_url, ())
        self.send(response.type_url, names, version=previous, nonce=response.nonce, error=error)

    async def close(self) -> None:
        self.requests.put_nowait(None)
        self.call.cancel()
        await self.channel.close()

    async def __aenter__(self) -> FakeEnvoy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def converge(envoy: FakeEnvoy, eds: tuple[str, ...] = ("a", "b")) -> None:
    """Play Envoy's start-up: CDS, EDS, LDS, RDS, each acked."""
    envoy.send(CLUSTER_TYPE)
    cds = await envoy.recv()
    assert cds.type_url == CLUSTER_TYPE
    envoy.send(ENDPOINT_TYPE, eds)
    eds_response = await envoy.recv()
    assert eds_response.type_url == ENDPOINT_TYPE
    envoy.ack(cds)
    envoy.ack(eds_response, eds)
    envoy.send(LISTENER_TYPE)
    lds = await envoy.recv()
    assert lds.type_url == LISTENER_TYPE
    envoy.send(ROUTE_TYPE, ("routes",))
    rds = await envoy.recv()
    assert rds.type_url == ROUTE_TYPE
    envoy.ack(lds)
    envoy.ack(rds, ("routes",))


async def play(envoy: FakeEnvoy, until: Any) -> Any:
    """ACK everything the server sends until the awaitable ``until`` is done."""
    waiter = asyncio.ensure_future(until)
    while not waiter.done():
        reader = asyncio.ensure_future(envoy.recv())
        await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
        if reader.done():
            envoy.ack(reader.result())
        else:
            reader.cancel()
    return waiter.result()


@pytest.fixture
async def server() -> AsyncIterator[tuple[AdsServer, int]]:
    ads = AdsServer(max_streams=8, first_request_timeout_s=5)
    port = await ads.start("127.0.0.1:0")
    try:
        yield ads, port
    finally:
        await ads.stop(0)


async def test_bad_dicts_are_refused_and_the_previous_snapshot_kept(server):
    ads, _ = server
    good = config("a")
    assert ads.set_snapshot(NODE, good)
    broken = snapshot(clusters=[{"name": "x", "no_such_field": 1}])
    assert not ads.set_snapshot(NODE, broken)
    nameless = snapshot(routes=[{"virtual_hosts": []}])
    assert not ads.set_snapshot(NODE, nameless)
    await asyncio.sleep(0)
    assert ads.snapshot(NODE) is good
    assert "no_such_field" in (ads.status(NODE).error or "") or ads.status(NODE).error
    assert ads.set_snapshot(NODE, config("b"))
    await asyncio.sleep(0)
    assert ads.status(NODE).error is None


async def test_startup_converges_and_wait_acked_says_so(server):
    ads, port = server
    target = config("a")
    ads.set_snapshot(NODE, target)
    async with FakeEnvoy(port) as envoy:
        waiter = asyncio.ensure_future(ads.wait_acked(NODE, target, timeout=10))
        await converge(envoy)
        assert await waiter
        status = ads.status(NODE)
        assert status.replicas == 1 and status.applied and not status.nacks
        assert ads.acked(NODE) == {t: target.version(t) for t in status.target}
        listeners = unpack(envoy.last[LISTENER_TYPE])
        assert listeners[0].address.socket_address.address == "0.0.0.0"


async def test_make_before_break_orders_a_change_that_drops_a_cluster(server):
    """a→b while dropping a: clusters a+b first, routes after that ACK, then a goes."""
    ads, port = server
    ads.set_snapshot(NODE, config("a", clusters=("a",)))
    async with FakeEnvoy(port) as envoy:
        await converge(envoy, eds=("a",))
        ads.set_snapshot(NODE, config("b", clusters=("b",)))
        cds = await envoy.recv()
        assert (cds.type_url, names(cds)) == (CLUSTER_TYPE, ["a", "b"])
        # The endpoints view changed too (a's stay, b's come): pushed for what Envoy has
        # asked for so far. Then Envoy warms b: it asks for its endpoints (acking the push)
        # before it acks the clusters.
        pushed = await envoy.recv()
        assert (pushed.type_url, names(pushed)) == (ENDPOINT_TYPE, ["a"])
        envoy.ack(pushed, ("a", "b"))
        eds = await envoy.recv()
        assert (eds.type_url, sorted(names(eds))) == (ENDPOINT_TYPE, ["a", "b"])
        envoy.ack(eds, ("a", "b"))
        # Routes must wait for the cluster ACK: asking for endpoints again is answered
        # first, and nothing about routes came before it.
        envoy.send(ENDPOINT_TYPE, ("a", "b"), version=eds.version_info, nonce=eds.nonce)
        again = await envoy.recv()
        assert again.type_url == ENDPOINT_TYPE
        envoy.ack(again, ("a", "b"))
        envoy.ack(cds)
        rds = await envoy.recv()
        assert rds.type_url == ROUTE_TYPE
        assert unpack(rds)[0].virtual_hosts[0].routes[0].route.cluster == "b"
        assert not ads.status(NODE).applied
        envoy.ack(rds, ("routes",))
        final = await envoy.recv()
        assert (final.type_url, names(final)) == (CLUSTER_TYPE, ["b"])
        # Envoy drops a, and its endpoints subscription with it; only then do a's
        # endpoints leave the server's view (never an empty answer for a live cluster).
        envoy.send(ENDPOINT_TYPE, ("b",), version=again.version_info, nonce=again.nonce)
        envoy.ack(final)
        target = config("b", clusters=("b",)).version(ENDPOINT_TYPE)
        while True:
            clean = await envoy.recv()
            assert (clean.type_url, names(clean)) == (ENDPOINT_TYPE, ["b"])
            envoy.ack(clean, ("b",))
            if clean.version_info == target:
                break
        assert await ads.wait_acked(NODE, timeout=10)


async def test_a_route_only_change_is_one_rds_exchange(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)
        target = config("b")
        ads.set_snapshot(NODE, target)
        rds = await envoy.recv()
        assert rds.type_url == ROUTE_TYPE
        envoy.ack(rds, ("routes",))
        assert await ads.wait_acked(NODE, target, timeout=10)
        assert ads.acked(NODE)[ROUTE_TYPE] == target.version(ROUTE_TYPE)


async def test_an_unchanged_snapshot_sends_nothing(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)
        assert ads.set_snapshot(NODE, config("a"))  # equal content, new object
        eds = envoy.last[ENDPOINT_TYPE]
        envoy.send(ENDPOINT_TYPE, ("a", "b"), version=eds.version_info, nonce=eds.nonce)
        assert (await envoy.recv()).type_url == ENDPOINT_TYPE  # nothing queued before it


async def test_a_repeated_request_is_answered_for_a_warming_cluster(server):
    """Envoy re-creates an updated EDS cluster and asks again for the endpoints it has."""
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)
        eds = envoy.last[ENDPOINT_TYPE]
        envoy.send(ENDPOINT_TYPE, ("a", "b"), version=eds.version_info, nonce=eds.nonce)
        again = await envoy.recv()
        assert again.type_url == ENDPOINT_TYPE and again.version_info == eds.version_info
        assert again.nonce != eds.nonce


async def test_endpoints_are_filtered_by_name_and_missing_ones_come_empty(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port) as envoy:
        envoy.send(ENDPOINT_TYPE, ("b", "ghost"))
        eds = await envoy.recv()
        assignments = {m.cluster_name: m for m in unpack(eds)}
        assert sorted(assignments) == ["b", "ghost"]
        assert len(assignments["b"].endpoints[0].lb_endpoints) == 1
        assert not assignments["ghost"].endpoints


async def test_nack_is_recorded_the_walk_stops_and_the_stream_keeps_serving(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)
        good_rds = envoy.last[ROUTE_TYPE]
        bad = config("b", clusters=("b",))
        ads.set_snapshot(NODE, bad)
        rds = await envoy.ack_until(ROUTE_TYPE)
        envoy.nack(rds, "route: invalid regex", previous=good_rds.version_info)
        assert not await ads.wait_acked(NODE, bad, timeout=10)
        status = ads.status(NODE)
        assert status.rejected and not status.applied
        assert [(n.type_url, n.message) for n in status.nacks] == [
            (ROUTE_TYPE, "route: invalid regex")
        ]
        assert status.acked[ROUTE_TYPE] == good_rds.version_info
        # No break stage after a NACK: cluster a (the old routes' target) stays. The
        # stream still answers: a repeated EDS request gets endpoints.
        eds = envoy.last[ENDPOINT_TYPE]
        envoy.send(ENDPOINT_TYPE, ("a", "b"), version=eds.version_info, nonce=eds.nonce)
        answer = await envoy.recv()
        assert answer.type_url == ENDPOINT_TYPE
        envoy.ack(answer)
        # The next good snapshot clears it.
        fixed = config("a")
        ads.set_snapshot(NODE, fixed)
        assert await play(envoy, ads.wait_acked(NODE, fixed, timeout=10))
        assert not ads.status(NODE).nacks


async def test_stale_nonces_are_ignored(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)
        ads.set_snapshot(NODE, config("b"))
        rds = await envoy.recv()
        # An answer to an older response changes nothing (the new one is still pending).
        envoy.send(ROUTE_TYPE, ("routes",), version="old", nonce="0")
        envoy.ack(rds, ("routes",))
        assert await ads.wait_acked(NODE, timeout=10)


async def test_bind_address_rewrites_wildcard_listeners_per_node(server):
    ads, port = server
    ads.set_snapshot("ns/one", config("a", port=80))
    ads.set_snapshot("ns/two", config("b", port=80))
    one = FakeEnvoy(port, "ns/one", {BIND_ADDRESS_KEY: "127.0.0.2"})
    two = FakeEnvoy(port, "ns/two", {BIND_ADDRESS_KEY: "$(POD_IP)"})  # unexpanded: ignored
    try:
        await converge(one)
        await converge(two)
        assert unpack(one.last[LISTENER_TYPE])[0].address.socket_address.address == "127.0.0.2"
        assert unpack(two.last[LISTENER_TYPE])[0].address.socket_address.address == "0.0.0.0"
        route = unpack(one.last[ROUTE_TYPE])[0].virtual_hosts[0].routes[0].route.cluster
        assert route == "a"
        assert unpack(two.last[ROUTE_TYPE])[0].virtual_hosts[0].routes[0].route.cluster == "b"
        assert await ads.wait_acked("ns/one", timeout=10)
        assert await ads.wait_acked("ns/two", timeout=10)
    finally:
        await one.close()
        await two.close()


async def test_every_replica_must_ack(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    first, second = FakeEnvoy(port), FakeEnvoy(port)
    try:
        await converge(first)
        await converge(second)
        target = config("b")
        ads.set_snapshot(NODE, target)
        rds_first = await first.recv()
        rds_second = await second.recv()
        first.ack(rds_first, ("routes",))
        await asyncio.sleep(0.1)
        assert ads.status(NODE).replicas == 2
        assert ROUTE_TYPE not in ads.acked(NODE)  # the replicas disagree
        second.ack(rds_second, ("routes",))
        assert await ads.wait_acked(NODE, target, timeout=10)
        await second.close()
        while ads.status(NODE).replicas != 1:
            await asyncio.sleep(0.05)
        assert ads.status(NODE).applied
    finally:
        await first.close()


async def test_set_snapshot_from_another_thread(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)
        target = config("b")
        thread = threading.Thread(target=ads.set_snapshot, args=(NODE, target))
        thread.start()
        thread.join()
        rds = await envoy.recv()
        envoy.ack(rds, ("routes",))
        assert await ads.wait_acked(NODE, target, timeout=10)


async def test_a_request_without_node_id_ends_only_that_stream(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    async with FakeEnvoy(port, node_id="") as anonymous:
        anonymous.send(CLUSTER_TYPE)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await anonymous.recv()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)


async def test_garbage_frames_and_a_stream_flood_do_not_take_the_server_down(server):
    ads, port = server
    ads.set_snapshot(NODE, config("a"))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    raw = channel.stream_stream(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
        request_serializer=lambda data: data,
        response_deserializer=lambda data: data,
    )

    async def garbage() -> AsyncIterator[bytes]:
        yield b"\xff\xfe not a protobuf \x00\x01"

    call = raw(garbage())
    with pytest.raises(grpc.aio.AioRpcError):
        await asyncio.wait_for(call.read(), 10)
    # More streams than max_streams: the extra ones are refused, the server lives.
    floods = [FakeEnvoy(port, node_id=f"flood/{i}") for i in range(12)]
    for i in range(12):
        ads.set_snapshot(f"flood/{i}", config("a"))
    for envoy in floods:
        envoy.send(CLUSTER_TYPE)
    results = await asyncio.gather(
        *(asyncio.wait_for(e.call.read(), 5) for e in floods), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    for envoy in floods:
        await envoy.close()
    await channel.close()
    while sum(ads.status(f"flood/{i}").replicas for i in range(12)):
        await asyncio.sleep(0.05)
    async with FakeEnvoy(port) as envoy:
        await converge(envoy)


def test_extension_types_parse_without_anyone_importing_their_modules(tmp_path):
    """Typed configs (ext_proc, header mutation, an LB policy) are found by type URL, in
    a fresh interpreter where nothing imported their generated modules first."""
    script = tmp_path / "parse.py"
    script.write_text(
        """
from infergate.gateway.types import CLUSTER_TYPE, LISTENER_TYPE, Snapshot
from infergate.gateway.xds_resources import compile_snapshot
T = "type.googleapis.com/envoy.extensions."
hcm = {
    "@type": T + "filters.network.http_connection_manager.v3.HttpConnectionManager",
    "stat_prefix": "x",
    "route_config": {"name": "r"},
    "http_filters": [
        {"name": "p", "typed_config": {"@type": T + "filters.http.ext_proc.v3.ExternalProcessor",
          "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}}}},
        {"name": "m", "typed_config": {"@type": T + "filters.http.header_mutation.v3.HeaderMutation"}},
        {"name": "r", "typed_config": {"@type": T + "filters.http.router.v3.Router"}},
    ],
}
listener = {"name": "l", "address": {"socket_address": {"address": "0.0.0.0", "port_value": 80}},
            "filter_chains": [{"filters": [{"name": "hcm", "typed_config": hcm}]}]}
cluster = {"name": "c", "type": "EDS", "eds_cluster_config": {"eds_config": {"ads": {}}},
           "load_balancing_policy": {"policies": [{"typed_extension_config": {"name": "lr",
             "typed_config": {"@type": T + "load_balancing_policies.least_request.v3.LeastRequest"}}}]}}
compiled = compile_snapshot(Snapshot({LISTENER_TYPE: (listener,), CLUSTER_TYPE: (cluster,)}))
print(len(compiled[LISTENER_TYPE].messages), len(compiled[CLUSTER_TYPE].messages))
"""
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]
