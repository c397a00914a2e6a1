"""The generated Envoy bootstrap: accepted by the real Envoy 1.40, and behaves as documented.

These run without an EPP: the dead-EPP paths (FailOpen to the fallback pool, FailClose
5xx, client-supplied destination headers ignored) are exactly the ones that need none.
The paths through a live EPP (EDS, fallback retries) are covered by tests/e2e and
conformance/.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from infergate.envoy.bootstrap import (
    DESTINATION_HEADER,
    EPP_CLUSTER,
    UPSTREAM_HOST_HEADER,
    UPSTREAM_IDLE_S,
    EnvoyConfig,
    build_envoy_config,
    duration,
    render_envoy_yaml,
)
from infergate.envoy.process import start_envoy, validate_config
from infergate.procs import ProcessGroup, free_port, tcp_ready
from infergate.wire.names import ORDER_DELAY_HEADER, PREFIX_HEADER, REQUEST_ID_HEADER


def _ext_proc(config: dict) -> dict:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    return next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"failure_mode_allow": False},
        {"failure_mode_allow": True, "fallback_endpoints": [("127.0.0.1", 8000)]},
        {"admin_port": None, "epp_address": "epp.default.svc.cluster.local"},
        {"debug_headers": True, "access_log": True, "route_timeout_s": 0.5},
        {"fallback_endpoints": [("engine-0.local", 8000), ("10.0.0.7", 8001)]},
        {"response_accounting": "none", "epp_health_check_interval_s": None},
        {"epp_tls": True},
        {"response_accounting": "body"},
        {"response_accounting": "observer"},
        {"epp_tls": True, "epp_address": "epp.default.svc.cluster.local"},
        {"upstream": "original_dst", "response_accounting": "body"},
        {
            "upstream": "original_dst",
            "failure_mode_allow": True,
            "fallback_endpoints": [("127.0.0.1", 8000)],
        },
        {"epp_replicas": [("127.0.0.1", 9012), ("127.0.0.1", 9022)]},
        {"epp_tls": True, "epp_replicas": [("epp-replicas.default.svc", 9002)]},
        {"response_accounting": "observer", "epp_replicas": [("127.0.0.1", 9012)]},
    ],
)
def test_real_envoy_accepts_the_config(kwargs: dict, tmp_path: Path, envoy_binary: Path) -> None:
    args = {"listen_port": 8081, "epp_address": "127.0.0.1", "epp_port": 9002, **kwargs}
    path = tmp_path / "envoy.yaml"
    path.write_text(render_envoy_yaml(EnvoyConfig(**args)))
    validate_config(path, envoy=envoy_binary)


def test_validate_reports_envoys_reason(tmp_path: Path, envoy_binary: Path) -> None:
    config = build_envoy_config(
        EnvoyConfig(listen_port=8081, epp_address="127.0.0.1", epp_port=9002)
    )
    pool = config["static_resources"]["clusters"][1]
    source = pool["eds_cluster_config"]["eds_config"]["api_config_source"]
    source["grpc_services"][0]["envoy_grpc"]["cluster_name"] = "nowhere"
    path = tmp_path / "bad.yaml"
    path.write_text(__import__("yaml").safe_dump(config))
    with pytest.raises(ValueError, match="'nowhere' does not exist"):
        validate_config(path, envoy=envoy_binary)


def test_full_duplex_streaming_and_failure_mode_follow_the_arguments() -> None:
    open_ = _ext_proc(
        build_envoy_config(
            EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2, failure_mode_allow=True)
        )
    )
    closed = _ext_proc(
        build_envoy_config(EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2))
    )
    assert open_["failure_mode_allow"] is True
    assert closed["failure_mode_allow"] is False
    mode = closed["processing_mode"]
    # Responses never go through the routing filter.
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["response_body_mode"] == "NONE"
    assert mode["request_trailer_mode"] == "SEND"
    config = build_envoy_config(EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    names = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    # Default: engines report completions, so no filter sees response bodies.
    assert "infergate.ext_proc.observer" not in names
    assert mode["response_trailer_mode"] == "SKIP"
    config = build_envoy_config(
        EnvoyConfig(
            listen_port=1, epp_address="127.0.0.1", epp_port=2, response_accounting="observer"
        )
    )
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    names = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    observer = hcm["typed_config"]["http_filters"][names.index("infergate.ext_proc.observer")]
    assert (
        names.index("infergate.ext_proc.observer") == names.index("envoy.filters.http.ext_proc") + 1
    )
    assert observer["typed_config"]["observability_mode"] is True
    assert observer["typed_config"]["processing_mode"]["response_body_mode"] == "STREAMED"
    # GIE's single filter, every response chunk through the EPP, on request.
    single = _ext_proc(
        build_envoy_config(
            EnvoyConfig(
                listen_port=1, epp_address="127.0.0.1", epp_port=2, response_accounting="body"
            )
        )
    )["processing_mode"]
    assert single["request_body_mode"] == single["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert single["request_trailer_mode"] == single["response_trailer_mode"] == "SEND"


def test_headers_only_the_epp_sets_are_removed_from_the_client_before_the_epp() -> None:
    """A client cannot pick its engine, its request id, its prefix record or its place in
    the engine's queue: those headers are removed before ext_proc runs (the EPP then sets
    its own)."""
    config = build_envoy_config(EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    names = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    strip = hcm["typed_config"]["http_filters"][names.index("envoy.filters.http.header_mutation")]
    removed = {m["remove"] for m in strip["typed_config"]["mutations"]["request_mutations"]}
    assert removed == {
        DESTINATION_HEADER,
        REQUEST_ID_HEADER,
        PREFIX_HEADER,
        ORDER_DELAY_HEADER,
    }
    assert names.index("envoy.filters.http.header_mutation") < names.index(
        "envoy.filters.http.ext_proc"
    )


def test_buffered_request_bodies_raise_envoys_buffer_to_the_body_limit() -> None:
    """Buffered, Envoy holds the body for the EPP: its 1 MiB default per-request buffer
    would refuse prompts the EPP accepts (tests/e2e/test_buffered_body.py sees the 413)."""
    base = EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2)
    config = build_envoy_config(
        dataclasses.replace(base, request_body_mode="buffered", max_request_body_bytes=3 << 20)
    )
    assert _ext_proc(config)["processing_mode"]["request_body_mode"] == "BUFFERED"
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (host,) = hcm["typed_config"]["route_config"]["virtual_hosts"]
    assert host["per_request_buffer_limit_bytes"] == 3 << 20
    streamed = build_envoy_config(base)
    hcm = streamed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert (
        "per_request_buffer_limit_bytes"
        not in hcm["typed_config"]["route_config"]["virtual_hosts"][0]
    )
    with pytest.raises(ValueError, match="request_body_mode must be one of streamed, buffered"):
        dataclasses.replace(base, request_body_mode="BUFFERED")


def test_pool_follows_the_epp_over_eds_and_retries_down_its_list() -> None:
    config = build_envoy_config(EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2))
    pool = config["static_resources"]["clusters"][1]
    assert pool["type"] == "EDS"
    source = pool["eds_cluster_config"]["eds_config"]["api_config_source"]
    (service,) = source["grpc_services"]
    assert service["envoy_grpc"]["cluster_name"] == EPP_CLUSTER
    # Redialled within a second, not Envoy's default backoff of up to 30 s
    # (tests/e2e/test_epp_starts_late.py shows the difference with a real Envoy).
    backoff = service["envoy_grpc"]["retry_policy"]["retry_back_off"]
    assert backoff == {"base_interval": "0.25s", "max_interval": "1s"}
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    # The ordered list comes from the EPP's envoy.lb metadata (the header holds one pick).
    assert policy["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}}
    ]
    picked = _routes(config)[0]["route"]
    assert picked["retry_policy"]["num_retries"] == 3
    assert "connect-failure" in picked["retry_policy"]["retry_on"]
    # Past the EPP's list, least-request must not redial a host that already failed.
    (predicate,) = picked["retry_policy"]["retry_host_predicate"]
    assert predicate["name"] == "envoy.retry_host_predicates.previous_hosts"
    no_retries = build_envoy_config(
        EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2, fallback_retries=0)
    )
    assert "retry_policy" not in _routes(no_retries)[0]["route"]


def test_original_dst_upstream_is_gies_reference_cluster() -> None:
    """For an EPP that serves no EDS: Envoy dials whatever the pick header names, and a
    request without a pick has no route (an ORIGINAL_DST cluster would dial the listener)."""
    config = build_envoy_config(
        EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2, upstream="original_dst")
    )
    pool = config["static_resources"]["clusters"][1]
    assert pool["type"] == "ORIGINAL_DST" and pool["lb_policy"] == "CLUSTER_PROVIDED"
    assert pool["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": DESTINATION_HEADER,
    }
    routes = _routes(config)
    assert len(routes) == 1 and routes[0]["match"]["dynamic_metadata"]
    with_fallback = build_envoy_config(EnvoyConfig(
        listen_port=1, epp_address="127.0.0.1", epp_port=2, upstream="original_dst",
        failure_mode_allow=True, fallback_endpoints=[("127.0.0.1", 8000)],
    ))  # fmt: skip
    assert _routes(with_fallback)[1]["route"]["cluster"] == "infergate_pool_fallback"
    # Both dial the engines, so they close idle connections before the engines do
    # (uvicorn's and vLLM's keep-alive: 5 s), as the EDS pool does.
    fallback = with_fallback["static_resources"]["clusters"][2]
    assert fallback["name"] == "infergate_pool_fallback"
    for cluster in (pool, fallback):
        (http,) = cluster["typed_extension_protocol_options"].values()
        assert http["common_http_protocol_options"]["idle_timeout"] == duration(UPSTREAM_IDLE_S)
    assert UPSTREAM_IDLE_S < 5.0
    with pytest.raises(ValueError, match="upstream must be one of eds, original_dst"):
        build_envoy_config(
            EnvoyConfig(listen_port=1, epp_address="127.0.0.1", epp_port=2, upstream="dns")
        )


def _routes(config: dict) -> list[dict]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="port"):
        build_envoy_config(EnvoyConfig(listen_port=70000, epp_address="127.0.0.1", epp_port=9002))
    with pytest.raises(ValueError, match="route_timeout_s"):
        build_envoy_config(
            EnvoyConfig(listen_port=8081, epp_address="127.0.0.1", epp_port=9002, route_timeout_s=0)
        )


def _start_upstream(processes: ProcessGroup, directory: Path) -> int:
    port = free_port()
    (directory / "hello.txt").write_text("hello from the pool\n")
    processes.start(
        "upstream",
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=directory,
        ready=tcp_ready("127.0.0.1", port),
        timeout=30,
    )
    return port


def _start_envoy(processes: ProcessGroup, tmp_path: Path, name: str, **kwargs: object) -> str:
    listen = free_port()
    config = build_envoy_config(
        EnvoyConfig(
            listen_port=listen,
            listen_address="127.0.0.1",
            admin_port=free_port(),
            epp_address="127.0.0.1",
            epp_port=free_port(),  # nothing listens there: the EPP is "down"
            message_timeout_s=5,
            debug_headers=True,
            eds_initial_fetch_timeout_s=0.5,
            **kwargs,  # type: ignore[arg-type]
        )
    )
    start_envoy(processes, config, tmp_path / f"{name}.yaml", name=name)
    return f"http://127.0.0.1:{listen}"


def test_dead_epp_fail_open_serves_from_fallback_and_fail_close_refuses(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    upstream = _start_upstream(processes, tmp_path)
    fail_open = _start_envoy(
        processes,
        tmp_path,
        "envoy-failopen",
        failure_mode_allow=True,
        fallback_endpoints=[("127.0.0.1", upstream)],
    )
    fail_close = _start_envoy(processes, tmp_path, "envoy-failclose", failure_mode_allow=False)
    fail_open_no_pool = _start_envoy(
        processes, tmp_path, "envoy-failopen-nopool", failure_mode_allow=True
    )
    with httpx.Client(timeout=20) as client:
        served = client.get(f"{fail_open}/hello.txt")
        assert served.status_code == 200
        assert served.text == "hello from the pool\n"
        assert served.headers[UPSTREAM_HOST_HEADER] == f"127.0.0.1:{upstream}"

        refused = client.get(f"{fail_close}/hello.txt")
        assert 500 <= refused.status_code < 600

        # A client cannot pick the upstream itself, even when the EPP is not there to:
        # with no EPP ever reached, the pool has no endpoints to fail open to.
        nopick = client.get(
            f"{fail_open_no_pool}/hello.txt",
            headers={DESTINATION_HEADER: f"127.0.0.1:{upstream}"},
        )
        assert nopick.status_code == 503
        assert "no healthy upstream" in nopick.text


def test_several_epp_replicas_are_one_cluster_that_routes_around_a_dead_one() -> None:
    config = build_envoy_config(
        EnvoyConfig(
            listen_port=8081,
            epp_address="127.0.0.1",
            epp_port=9002,
            epp_replicas=(("127.0.0.1", 9012), ("127.0.0.1", 9022)),
            response_accounting="observer",
        )
    )
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    epp = clusters[EPP_CLUSTER]
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports == [9002, 9012, 9022]
    assert epp["outlier_detection"]["consecutive_local_origin_failure"] == 1
    # A dead replica is found by its failed connection: the active checks are slower.
    (check,) = epp["health_checks"]
    assert check["interval"] == duration(EnvoyConfig.epp_replica_health_check_interval_s)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    services = [
        f["typed_config"]["grpc_service"]
        for f in hcm["typed_config"]["http_filters"]
        if "grpc_service" in f.get("typed_config", {})
    ]
    assert len(services) == 2  # the routing filter and the observer
    assert all("connect-failure" in s["retry_policy"]["retry_on"] for s in services)
    # One replica: neither (its behaviour is unchanged).
    single = build_envoy_config(
        EnvoyConfig(listen_port=8081, epp_address="127.0.0.1", epp_port=9002)
    )
    one = {c["name"]: c for c in single["static_resources"]["clusters"]}[EPP_CLUSTER]
    assert "outlier_detection" not in one
    assert "retry_policy" not in _ext_proc(single)["grpc_service"]
    assert one["health_checks"][0]["interval"] == duration(1.0)  # the only way it is found dead


def test_overload_manager_bounds_the_heap_and_envoy_accepts_it(
    tmp_path: Path, envoy_binary: Path
) -> None:
    """Both generated bootstraps carry the heap bound, shrink near it and refuse new
    requests at it; Envoy 1.40 accepts them (the Gateway's too), mTLS files included."""
    from infergate.epp.server import tls

    from infergate.envoy.bootstrap import EppMutualTls
    from infergate.gateway.bootstrap import GatewayProxy, build_gateway_bootstrap

    tls.write_bundle(tmp_path, tls.mutual_tls_bundle())
    mutual = EppMutualTls(
        ca_file=str(tmp_path / tls.CA_CERT),
        cert_file=str(tmp_path / tls.CLIENT_CERT),
        key_file=str(tmp_path / tls.CLIENT_KEY),
        server_name=tls.EPP_SERVER_NAME,
    )
    standalone = EnvoyConfig(
        listen_port=8081, epp_address="127.0.0.1", epp_port=9002, epp_mtls=mutual,
        max_heap_bytes=256 << 20,
    )  # fmt: skip
    gateway = build_gateway_bootstrap(
        GatewayProxy(node_id="gw", xds_host="127.0.0.1", xds_port=18000, max_heap_bytes=256 << 20)
    )
    for name, bootstrap in (("standalone", build_envoy_config(standalone)), ("gw", gateway)):
        overload = bootstrap["overload_manager"]
        heap = overload["resource_monitors"][0]
        assert heap["name"] == "envoy.resource_monitors.fixed_heap"
        assert heap["typed_config"]["max_heap_size_bytes"] == 256 << 20
        actions = {a["name"]: a["triggers"][0]["threshold"]["value"] for a in overload["actions"]}
        assert actions == {
            "envoy.overload_actions.shrink_heap": 0.95,
            "envoy.overload_actions.stop_accepting_requests": 0.98,
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        validate_config(path, envoy=envoy_binary)
