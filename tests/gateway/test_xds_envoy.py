"""The real Envoy on the ADS server: config changes land without restarts or cut streams.

Each test runs the server on a background event loop (as on the operator's), a Gateway
Envoy from infergate.gateway.bootstrap, and two SSE backends ``a`` and ``b`` that say who
answered. Streams "in flight" are held open by the backend (``hold=1``) until the change
has been acked, so nothing here depends on timing.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infergate.gateway.types import ROUTE_TYPE, Snapshot
from infergate.gateway.xds import AdsServer
from infergate.procs import ManagedProcess, ProcessGroup, free_port
from tests.support.xds_harness import (
    BackgroundLoop,
    SseBackend,
    assignment,
    check_sse,
    eds_cluster,
    http_listener,
    route_config,
    route_snapshot,
    snapshot,
    start_gateway_envoy,
)

NODE = "default/gw"
EVENTS = 5


@dataclass
class Rig:
    loop: BackgroundLoop
    server: AdsServer
    xds_port: int
    backends: dict[str, SseBackend]
    processes: ProcessGroup
    workdir: Path
    listen_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)

    def publish(self, target: Snapshot, node_id: str = NODE) -> bool:
        """Set ``target`` and wait until every replica of ``node_id`` serves it."""
        assert self.server.set_snapshot(node_id, target)
        return self.loop.run(self.server.wait_acked(node_id, target, timeout=30))

    def routed_to(self, route_to: str, **kwargs: str) -> Snapshot:
        return route_snapshot(self.listen_port, self.backends, route_to, **kwargs)

    def envoy(
        self,
        name: str = "envoy",
        node_id: str = NODE,
        *,
        admin_port: int | None = None,
        bind_address: str | None = None,
        ready_port: int | None = None,
        ready: bool = True,
    ) -> ManagedProcess:
        return start_gateway_envoy(
            self.processes,
            self.workdir,
            name=name,
            node_id=node_id,
            xds_port=self.xds_port,
            admin_port=admin_port or self.admin_port,
            bind_address=bind_address,
            ready_port=ready_port,
            ready=ready,
        )


@pytest.fixture
def rig(processes: ProcessGroup, tmp_path: Path) -> Iterator[Rig]:
    loop = BackgroundLoop()
    server = AdsServer()
    port = loop.run(server.start("127.0.0.1:0"))
    backends = {"a": SseBackend("a"), "b": SseBackend("b")}
    rig = Rig(loop, server, port, backends, processes, tmp_path)
    try:
        yield rig
    finally:
        processes.stop_all()
        for backend in backends.values():
            backend.gate.set()
            backend.close()
        loop.run(rig.server.stop(0))
        loop.close()


def who(port: int, host: str = "127.0.0.1") -> str:
    """The backend that answers a plain request through Envoy."""
    with urllib.request.urlopen(f"http://{host}:{port}/who", timeout=10) as response:
        return str(json.loads(response.read())["backend"])


class HeldStream:
    """An SSE request through Envoy, held by its backend after the first event."""

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.connection.request("GET", f"/sse?events={EVENTS}&interval_ms=5&hold=1")
        self.response = self.connection.getresponse()
        assert self.response.status == 200
        self.head = self.response.readline() + self.response.readline()
        assert self.head.startswith(b"data: {")

    def finish(self) -> str | None:
        """Read to the end: the backend when the stream arrived whole, else None."""
        try:
            body = self.head + self.response.read()
        except (http.client.HTTPException, OSError):
            return None
        finally:
            self.connection.close()
        return check_sse(body, EVENTS)


def clusters(admin_port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters?format=json") as r:
        return {c["name"] for c in json.loads(r.read())["cluster_statuses"]}


def test_envoy_serves_the_snapshot_and_follows_a_route_change_without_restart(rig):
    rig.server.set_snapshot(NODE, rig.routed_to("a"))
    envoy = rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    assert who(rig.listen_port) == "a"
    assert rig.publish(rig.routed_to("b"))
    assert who(rig.listen_port) == "b"
    assert rig.publish(rig.routed_to("a"))
    assert who(rig.listen_port) == "a"
    assert envoy.alive()
    assert rig.server.status(NODE).replicas == 1


def test_a_stream_in_flight_survives_a_route_change(rig):
    rig.server.set_snapshot(NODE, rig.routed_to("a"))
    rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    stream = HeldStream(rig.listen_port)
    assert rig.publish(rig.routed_to("b"))
    assert who(rig.listen_port) == "b"
    rig.backends["a"].gate.set()
    assert stream.finish() == "a"


@pytest.mark.parametrize("change", ["drop", "modify"])
def test_a_stream_in_flight_survives_a_cluster_change(rig, change):
    """The cluster the stream runs on is removed (its route moves to b) or redefined."""
    a, b = rig.backends["a"], rig.backends["b"]
    rig.server.set_snapshot(NODE, rig.routed_to("a"))
    rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    stream = HeldStream(rig.listen_port)
    if change == "drop":
        target = snapshot(
            listeners=[http_listener("http", rig.listen_port, "routes")],
            routes=[route_config("routes", "b")],
            clusters=[eds_cluster("b")],
            assignments=[assignment("b", [(b.host, b.port)])],
        )
    else:
        target = snapshot(
            listeners=[http_listener("http", rig.listen_port, "routes")],
            routes=[route_config("routes", "a")],
            clusters=[eds_cluster("a", connect_timeout="2s"), eds_cluster("b")],
            assignments=[assignment("a", [(a.host, a.port)]), assignment("b", [(b.host, b.port)])],
        )
    assert rig.publish(target)
    if change == "drop":
        assert "a" not in clusters(rig.admin_port)
        assert who(rig.listen_port) == "b"
    else:
        assert who(rig.listen_port) == "a"
    a.gate.set()
    assert stream.finish() == "a"


def test_a_stream_in_flight_survives_a_listener_change(rig):
    """A modified listener (here: it names another route configuration) drains: the old
    connection finishes its stream while new ones get the new listener."""
    a, b = rig.backends["a"], rig.backends["b"]
    rig.server.set_snapshot(NODE, rig.routed_to("a"))
    rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    stream = HeldStream(rig.listen_port)
    target = snapshot(
        listeners=[http_listener("http", rig.listen_port, "routes-2")],
        routes=[route_config("routes-2", "b")],
        clusters=[eds_cluster("a"), eds_cluster("b")],
        assignments=[assignment("a", [(a.host, a.port)]), assignment("b", [(b.host, b.port)])],
    )
    assert rig.publish(target)
    assert who(rig.listen_port) == "b"
    rig.backends["a"].gate.set()
    assert stream.finish() == "a"


def test_requests_never_fail_while_routes_move_between_clusters_that_come_and_go(rig):
    """Each change routes to the other backend through a cluster the previous snapshot
    did not have, and drops the old one: clients polling meanwhile never see an error
    (without make-before-break, some get 503 cluster_not_found)."""
    rig.server.set_snapshot(NODE, only(rig, "a"))
    rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    stop = threading.Event()
    answers: list[str] = []
    failures: list[BaseException] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                answers.append(who(rig.listen_port))
            except Exception as error:
                failures.append(error)

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for poller in pollers:
        poller.start()
    try:
        for index in range(20):
            assert rig.publish(only(rig, "ba"[index % 2]))
    finally:
        stop.set()
        for poller in pollers:
            poller.join()
    assert not failures
    assert set(answers) == {"a", "b"}


def only(rig: Rig, backend: str) -> Snapshot:
    """Everything routed to ``backend``, whose cluster is the only one."""
    return route_snapshot(rig.listen_port, {backend: rig.backends[backend]}, backend)


def test_a_nacked_snapshot_leaves_the_previous_config_serving(rig):
    rig.server.set_snapshot(NODE, rig.routed_to("a"))
    rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    bad = rig.routed_to("b", regex="([")  # not RE2: Envoy rejects the route config
    assert not rig.publish(bad)
    status = rig.server.status(NODE)
    assert status.rejected
    assert [nack.type_url for nack in status.nacks] == [ROUTE_TYPE]
    assert "[" in status.nacks[0].message
    assert who(rig.listen_port) == "a"
    assert rig.publish(rig.routed_to("b"))
    assert who(rig.listen_port) == "b"
    assert not rig.server.status(NODE).nacks


def test_two_gateways_on_one_host_each_get_their_own_config(rig):
    """Same listener port, two node ids, each Envoy bound to its own loopback IP."""
    rig.server.set_snapshot("ns/one", rig.routed_to("a"))
    rig.server.set_snapshot("ns/two", rig.routed_to("b"))
    rig.envoy("one", "ns/one", bind_address="127.0.0.2", admin_port=free_port())
    rig.envoy("two", "ns/two", bind_address="127.0.0.3", admin_port=free_port())
    assert rig.loop.run(rig.server.wait_acked("ns/one", timeout=30))
    assert rig.loop.run(rig.server.wait_acked("ns/two", timeout=30))
    assert who(rig.listen_port, "127.0.0.2") == "a"
    assert who(rig.listen_port, "127.0.0.3") == "b"
    assert rig.publish(rig.routed_to("b"), "ns/one")
    assert who(rig.listen_port, "127.0.0.2") == "b"


def test_a_restarted_envoy_gets_the_current_snapshot(rig):
    rig.server.set_snapshot(NODE, rig.routed_to("a"))
    envoy = rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    envoy.stop()
    rig.server.set_snapshot(NODE, rig.routed_to("b"))
    rig.envoy("envoy-2")
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    assert who(rig.listen_port) == "b"


def test_envoy_keeps_serving_through_a_server_restart_and_takes_the_next_snapshot(rig):
    rig.server.set_snapshot(NODE, rig.routed_to("a"))
    rig.envoy()
    assert rig.loop.run(rig.server.wait_acked(NODE, timeout=30))
    rig.loop.run(rig.server.stop(0))
    assert who(rig.listen_port) == "a"  # no server: the last config serves
    rig.server = AdsServer()
    rig.loop.run(rig.server.start(f"127.0.0.1:{rig.xds_port}"))
    assert rig.publish(rig.routed_to("b"))  # Envoy reconnected on its own
    assert who(rig.listen_port) == "b"


def test_envoy_is_not_ready_until_its_first_config_arrives(rig):
    """No snapshot yet: the running Envoy stays initializing and its readiness port
    does not say ready (Envoy opens listeners only once initialized); then it does."""
    ready_port = free_port()
    rig.envoy(ready_port=ready_port, ready=False)
    deadline = time.monotonic() + 30
    while status_of(f"http://127.0.0.1:{rig.admin_port}/ready") is None:
        assert time.monotonic() < deadline, "the admin API never came up"
        time.sleep(0.05)
    assert status_of(f"http://127.0.0.1:{rig.admin_port}/ready") == 503
    assert status_of(f"http://127.0.0.1:{ready_port}/ready") in (None, 503)
    assert rig.publish(rig.routed_to("a"))
    assert status_of(f"http://127.0.0.1:{ready_port}/ready") == 200
    assert who(rig.listen_port) == "a"


def status_of(url: str) -> int | None:
    """The HTTP status ``url`` answers, None when nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None
