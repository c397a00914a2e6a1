"""What the translator generates is what Envoy 1.40 accepts, and behaves as intended.

* every resource of a rich snapshot parses into its Envoy v3 proto (``@type``s resolved);
* the real binary validates it, both as the ADS client sees it (EDS clusters, RDS) and
  rendered static (so routes and endpoints are checked too);
* the real binary serves it: a fake EPP's pick is honoured on its pool's route only,
  FailOpen and FailClose follow each pool's ``failureMode``, invalid backends answer 500
  (all of a rule, or their weighted share), filters apply, unknown hosts get 404.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2  # noqa: F401 (Any types)
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from gateway_objects import (
    APPS,
    INFRA,
    gateway,
    gateway_class,
    http_route,
    listener,
    namespace,
    parent,
    path,
    pod,
    pool,
    pool_ref,
    rule,
    service,
    service_ref,
    world,
)
from google.protobuf.json_format import ParseDict

from infergate.envoy.process import start_envoy, validate_config
from infergate.gateway.static import runtime_layer, static_bootstrap
from infergate.gateway.translate import TranslateOptions, translate
from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    ClusterObjects,
    Snapshot,
)
from infergate.procs import ProcessGroup, free_port
from infergate.wire.names import DESTINATION_HEADER

MESSAGES = {
    CLUSTER_TYPE: cluster_pb2.Cluster,
    ENDPOINT_TYPE: endpoint_pb2.ClusterLoadAssignment,
    LISTENER_TYPE: listener_pb2.Listener,
    ROUTE_TYPE: route_pb2.RouteConfiguration,
}
GW = (INFRA, "gw")


def rich_world() -> ClusterObjects:
    """The conformance-shaped world plus every feature the translator renders."""
    base = world()
    extra_routes = (
        http_route(
            "features",
            hostnames=["features.example.com", "*.wild.example.com"],
            rules=[
                rule(
                    [service_ref("echo"), service_ref("missing")],
                    [path("/split"), {"path": {"type": "Exact", "value": "/exact"}}],
                    filters=[
                        {
                            "type": "RequestHeaderModifier",
                            "requestHeaderModifier": {
                                "set": [{"name": "x-set", "value": "100%"}],
                                "add": [{"name": "x-add", "value": "a"}],
                                "remove": ["x-drop"],
                            },
                        },
                        {
                            "type": "ResponseHeaderModifier",
                            "responseHeaderModifier": {"add": [{"name": "x-resp", "value": "r"}]},
                        },
                    ],
                    timeouts={"request": "10s", "backendRequest": "2s"},
                ),
                rule(
                    matches=[
                        {
                            # Over Envoy's default RE2 limit of 100: needs the runtime layer.
                            "path": {"type": "RegularExpression", "value": "/v[0-9]+/[a-z]{0,64}"},
                            "headers": [
                                {"name": "x-a", "value": "1"},
                                {"type": "RegularExpression", "name": "x-b", "value": "b.*"},
                            ],
                            "queryParams": [{"name": "q", "value": "1"}],
                            "method": "POST",
                        }
                    ],
                    filters=[
                        {
                            "type": "RequestRedirect",
                            "requestRedirect": {"scheme": "https", "statusCode": 301},
                        }
                    ],
                ),
                rule(
                    [
                        service_ref(
                            "echo",
                            filters=[
                                {
                                    "type": "RequestHeaderModifier",
                                    "requestHeaderModifier": {
                                        "set": [{"name": "x-b", "value": "1"}]
                                    },
                                }
                            ],
                        )
                    ],
                    [path("/rewrite")],
                    filters=[
                        {
                            "type": "URLRewrite",
                            "urlRewrite": {
                                "hostname": "rewritten.example.com",
                                "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/"},
                            },
                        }
                    ],
                ),
                rule([pool_ref("h2c")], [path("/h2c")]),
                rule(
                    [pool_ref("primary", weight=3), pool_ref("secondary", weight=1)],
                    [path("/weighted")],
                ),
                rule([{"group": "x.io", "kind": "Thing", "name": "t"}], [path("/bad-kind")]),
                rule(filters=[{"type": "CORS", "cors": {}}], matches=[path("/cors")]),
            ],
        ),
    )
    return ClusterObjects(
        gateway_classes=base.gateway_classes,
        gateways=(
            gateway(
                listeners=[
                    listener(from_="All"),
                    listener("other", port=8080, hostname="*.example.com", from_="All"),
                ]
            ),
        ),
        http_routes=(
            *base.http_routes,
            *extra_routes,
            http_route("on-8080", parents=[parent(section="other")]),
        ),
        inference_pools=(
            *base.inference_pools,
            pool(
                "h2c",
                ports=(3001, 3002),
                epp=("primary-epp", 9002),
                app_protocol="kubernetes.io/h2c",
            ),
        ),
        services=base.services,
        pods=(*base.pods, pod("h2c-0", "10.0.5.1", {"app": "h2c"})),
        namespaces=base.namespaces,
        gateway_addresses=base.gateway_addresses,
        gateway_programmed=base.gateway_programmed,
    )


@pytest.fixture(scope="module")
def rich_snapshot() -> Snapshot:
    options = TranslateOptions(now="2025-01-02T00:00:00Z", access_log=True, epp_health_check="grpc")
    return translate(rich_world(), options).snapshots[GW]


def test_every_resource_parses_as_its_proto(rich_snapshot: Snapshot) -> None:
    for type_url, message in MESSAGES.items():
        assert rich_snapshot.resources[type_url], type_url
        for resource in rich_snapshot.resources[type_url]:
            ParseDict(resource, message())  # raises on an unknown field or @type


def test_real_envoy_validates_the_ads_view(
    rich_snapshot: Snapshot, tmp_path: Path, envoy_binary: Path
) -> None:
    """As an ADS client gets it: listeners with RDS, EDS clusters."""
    xds = {
        "name": "xds",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {"cluster_name": "xds", "endpoints": []},
    }
    config = {
        "node": {"id": "infra/gw", "cluster": "gw"},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds"}}],
            }
        },
        "static_resources": {
            "listeners": list(rich_snapshot.resources[LISTENER_TYPE]),
            "clusters": [*rich_snapshot.resources[CLUSTER_TYPE], xds],
        },
        "layered_runtime": runtime_layer(),
    }
    (tmp_path / "ads.json").write_text(json.dumps(config))
    validate_config(tmp_path / "ads.json", envoy=envoy_binary)


def test_real_envoy_validates_routes_and_endpoints(
    rich_snapshot: Snapshot, tmp_path: Path, envoy_binary: Path
) -> None:
    config = static_bootstrap(rich_snapshot, "infra/gw")
    (tmp_path / "static.json").write_text(json.dumps(config))
    validate_config(tmp_path / "static.json", envoy=envoy_binary)


# --- Envoy serving a translation ----------------------------------------------------


class _Echo(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        host, port = self.connection.getsockname()[:2]
        body = json.dumps(
            {"server": f"{host}:{port}", "path": self.path, "headers": dict(self.headers)}
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _PickingEpp(pb_grpc.ExternalProcessorServicer):
    """A minimal EPP: answers the request headers with a fixed pick."""

    def __init__(self, pick: str) -> None:
        self.pick = pick
        self.streams = 0

    def Process(self, request_iterator: Any, context: Any) -> Iterator[pb.ProcessingResponse]:
        self.streams += 1
        for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                header = base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(
                        key=DESTINATION_HEADER, raw_value=self.pick.encode()
                    )
                )
                mutation = pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(set_headers=[header])
                )
                # GIE's protocol: the pick in the header and in envoy.lb metadata, which is
                # what the pool's override_host reads.
                answer = pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=mutation)
                )
                answer.dynamic_metadata.update({"envoy.lb": {DESTINATION_HEADER: self.pick}})
                yield answer
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())


@pytest.fixture
def servers() -> Iterator[dict[str, ThreadingHTTPServer]]:
    """Echo servers on several loopback addresses (pods of the test world)."""
    port = free_port()
    started = {}
    for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"):
        server = ThreadingHTTPServer((ip, port), _Echo)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started[ip] = server
    yield started
    for server in started.values():
        server.shutdown()
        server.server_close()


@pytest.fixture
def picking_epp() -> Iterator[tuple[_PickingEpp, int]]:
    servicer = _PickingEpp(pick="")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def serving_world(app_port: int, epp_port: int, dead_port: int) -> ClusterObjects:
    """Three pools (one with a live EPP, two whose EPP is down: FailOpen, FailClose), a
    Service, and routes exercising invalid backends, weights, filters and hostnames."""
    app = {"http": app_port}
    return ClusterObjects(
        gateway_classes=(gateway_class(),),
        gateways=(gateway(),),
        http_routes=(
            http_route(
                "r",
                rules=[
                    rule([pool_ref("picked")], [path("/picked")]),
                    rule([pool_ref("open")], [path("/open")]),
                    rule([pool_ref("closed")], [path("/closed")]),
                    rule([pool_ref("picked"), pool_ref("open")], [path("/two-pools")]),
                    rule(
                        [service_ref("web", port=80)],
                        [path("/web")],
                        filters=[
                            {
                                "type": "RequestHeaderModifier",
                                "requestHeaderModifier": {
                                    "set": [{"name": "x-set", "value": "50%"}]
                                },
                            },
                            {
                                "type": "ResponseHeaderModifier",
                                "responseHeaderModifier": {
                                    "add": [{"name": "x-resp", "value": "yes"}]
                                },
                            },
                        ],
                    ),
                    rule([service_ref("missing")], [path("/missing")]),
                    rule([service_ref("web", port=80), service_ref("missing")], [path("/half")]),
                    rule(
                        matches=[path("/redirect")],
                        filters=[
                            {
                                "type": "RequestRedirect",
                                "requestRedirect": {"hostname": "example.org", "statusCode": 301},
                            }
                        ],
                    ),
                    rule(
                        [service_ref("web", port=80)],
                        [path("/old")],
                        filters=[
                            {
                                "type": "URLRewrite",
                                "urlRewrite": {
                                    "path": {
                                        "type": "ReplacePrefixMatch",
                                        "replacePrefixMatch": "/new",
                                    }
                                },
                            }
                        ],
                    ),
                ],
            ),
            http_route(
                "hosted",
                hostnames=["only.example.com"],
                rules=[rule([service_ref("web", port=80)], [path("/hosted")])],
            ),
        ),
        inference_pools=(
            pool("picked", ports=(app_port,), epp=("picker", 9002)),
            pool("open", ports=(app_port,), epp=("dead", 9002), failure_mode="FailOpen"),
            pool("closed", ports=(app_port,), epp=("dead", 9002)),
        ),
        services=(
            service("picker", ports=[{"port": 9002, "targetPort": epp_port}]),
            service("dead", ports=[{"port": 9002, "targetPort": dead_port}]),
            service("web", ports=[{"port": 80, "targetPort": "http"}]),
        ),
        pods=(
            pod("picker-0", "127.0.0.1", {"app": "picker"}),
            pod("dead-0", "127.0.0.1", {"app": "dead"}),
            pod("picked-0", "127.0.0.2", {"app": "picked"}, ports=app),
            pod("picked-1", "127.0.0.3", {"app": "picked"}, ports=app),
            pod("open-0", "127.0.0.4", {"app": "open"}, ports=app),
            pod("closed-0", "127.0.0.5", {"app": "closed"}, ports=app),
            pod("web-0", "127.0.0.6", {"app": "web"}, ports=app),
        ),
        namespaces=(namespace(INFRA), namespace(APPS)),
        gateway_programmed={GW: True},
    )


def test_real_envoy_serves_the_translation(
    servers: dict[str, ThreadingHTTPServer],
    picking_epp: tuple[_PickingEpp, int],
    tmp_path: Path,
) -> None:
    epp, epp_port = picking_epp
    app_port = servers["127.0.0.2"].server_address[1]
    epp.pick = f"127.0.0.3:{app_port}"
    objects = serving_world(app_port, epp_port, dead_port=free_port())
    options = TranslateOptions(epp_tls=False, response_bodies=False, now="2025-01-02T00:00:00Z")
    snapshot = translate(objects, options).snapshots[GW]
    listen, admin = free_port(), free_port()
    config = static_bootstrap(snapshot, "infra/gw", admin_port=admin, ports={80: listen})
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(config))
    with ProcessGroup() as processes:
        start_envoy(processes, config, tmp_path / "envoy.yaml", log_path=tmp_path / "envoy.log")
        with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=10) as client:
            _check_serving(client, epp, app_port)


def _served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["server"])


def _check_serving(client: httpx.Client, epp: _PickingEpp, app_port: int) -> None:
    # The EPP's pick is honoured, and the client cannot pick by itself.
    for _ in range(5):
        got = client.get("/picked", headers={DESTINATION_HEADER: f"127.0.0.2:{app_port}"})
        assert _served_by(got) == f"127.0.0.3:{app_port}"
    assert epp.streams >= 5
    streams = epp.streams
    # EPP down: FailOpen serves from the pool, FailClose refuses; neither asks the live EPP.
    assert _served_by(client.get("/open")) == f"127.0.0.4:{app_port}"
    assert client.get("/closed").status_code >= 500
    # Split across two pools: each share goes through its own pool's EPP (ext_proc
    # overrides per weighted cluster), so the live EPP sees exactly its share.
    streams = epp.streams
    served = [_served_by(client.get("/two-pools")) for _ in range(40)]
    assert set(served) == {f"127.0.0.3:{app_port}", f"127.0.0.4:{app_port}"}
    assert epp.streams - streams == served.count(f"127.0.0.3:{app_port}")
    streams = epp.streams
    # Plain Services: no ext_proc at all, filters applied.
    web = client.get("/web/x", headers={"x-set": "client"})
    assert _served_by(web) == f"127.0.0.6:{app_port}"
    assert web.json()["headers"]["x-set"] == "50%"
    assert web.headers["x-resp"] == "yes"
    assert epp.streams == streams
    # Invalid backends: 500 for the whole rule, or for their weighted share.
    assert client.get("/missing").status_code == 500
    codes = {client.get("/half").status_code for _ in range(40)}
    assert codes == {200, 500}
    redirect = client.get("/redirect")
    assert redirect.status_code == 301
    assert redirect.headers["location"] == "http://example.org/redirect"
    assert client.get("/old/page").json()["path"] == "/new/page"
    assert client.get("/hosted", headers={"host": "only.example.com:8080"}).status_code == 200
    assert client.get("/hosted").status_code == 404
    assert client.get("/nowhere").status_code == 404
