"""The Gateway proxy's bootstrap and command line, checked by the real Envoy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from infergate.gateway.bootstrap import (
    POD_IP_ARG,
    XDS_CLUSTER,
    GatewayProxy,
    build_gateway_bootstrap,
    gateway_proxy_args,
    render_gateway_bootstrap,
)
from infergate.gateway.xds import BIND_ADDRESS_KEY


def validate(envoy: Path, path: Path, *args: str) -> None:
    """``envoy --mode validate`` with the proxy's own arguments (--config-yaml included)."""
    result = subprocess.run(
        [str(envoy), "--mode", "validate", *gateway_proxy_args(path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("host", ["10.96.0.12", "infergate.infergate-system.svc"])
def test_envoy_accepts_the_bootstrap_and_its_arguments(envoy_binary, tmp_path, host):
    proxy = GatewayProxy(node_id="default/gw", xds_host=host, xds_port=18000)
    path = tmp_path / "bootstrap.json"
    path.write_text(render_gateway_bootstrap(proxy))
    validate(envoy_binary, path)
    cluster = build_gateway_bootstrap(proxy)["static_resources"]["clusters"][0]
    assert cluster["name"] == XDS_CLUSTER
    assert cluster["type"] == ("STATIC" if host[0].isdigit() else "STRICT_DNS")


def test_everything_but_the_xds_cluster_comes_over_ads():
    bootstrap = build_gateway_bootstrap(GatewayProxy(node_id="ns/gw", xds_host="x", xds_port=1))
    assert bootstrap["node"]["id"] == "ns/gw"
    dynamic = bootstrap["dynamic_resources"]
    assert dynamic["ads_config"]["api_type"] == "GRPC"
    assert dynamic["ads_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] == XDS_CLUSTER
    for key in ("cds_config", "lds_config"):
        assert "ads" in dynamic[key]
        # Not ready until the operator answered, rather than live with no config.
        assert dynamic[key]["initial_fetch_timeout"] == "0s"
    assert set(bootstrap["static_resources"]) == {"clusters"}
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_admin_on_a_unix_socket_with_a_readiness_listener(envoy_binary, tmp_path):
    proxy = GatewayProxy(
        node_id="ns/gw",
        xds_host="127.0.0.1",
        xds_port=18000,
        admin_socket="/tmp/admin.sock",
        ready_port=19001,
    )
    bootstrap = build_gateway_bootstrap(proxy)
    assert bootstrap["admin"]["address"] == {"pipe": {"path": "/tmp/admin.sock", "mode": 0o600}}
    path = tmp_path / "bootstrap.json"
    path.write_text(render_gateway_bootstrap(proxy))
    validate(envoy_binary, path)


def test_the_command_line_carries_the_pod_ip_and_graceful_drain():
    args = gateway_proxy_args("/etc/envoy/bootstrap.json")
    assert args[:2] == ["-c", "/etc/envoy/bootstrap.json"]
    merged = json.loads(args[args.index("--config-yaml") + 1])
    assert merged == {"node": {"metadata": {BIND_ADDRESS_KEY: POD_IP_ARG}}}
    assert args[args.index("--drain-strategy") + 1] == "immediate"
    assert int(args[args.index("--drain-time-s") + 1]) >= 300
    assert "--disable-hot-restart" in args
    assert "--config-yaml" not in gateway_proxy_args("b.json", bind_address=None)


def test_a_node_id_that_yaml_would_read_as_a_boolean_survives(envoy_binary, tmp_path):
    proxy = GatewayProxy(node_id="n", xds_host="127.0.0.1", xds_port=18000)
    path = tmp_path / "bootstrap.json"
    path.write_text(render_gateway_bootstrap(proxy))
    validate(envoy_binary, path)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        GatewayProxy(node_id="", xds_host="x", xds_port=1)
    with pytest.raises(ValueError):
        GatewayProxy(node_id="a/b", xds_host="x", xds_port=70000)
    with pytest.raises(ValueError):
        GatewayProxy(node_id="a/b", xds_host="x", xds_port=1, reconnect_base_s=10)
    with pytest.raises(ValueError):
        GatewayProxy(node_id="a/b", xds_host="x", xds_port=1, admin_port=None, ready_port=2)
