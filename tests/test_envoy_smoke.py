"""The real Envoy binary, started by the harness, proxies to a local upstream."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import yaml

from infergate.procs import ProcessGroup, free_port, http_ready, tcp_ready


def static_envoy_config(listen_port: int, admin_port: int, upstream_port: int) -> dict:
    cluster = {
        "name": "upstream",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "upstream",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": "127.0.0.1",
                                        "port_value": upstream_port,
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "smoke",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "smoke",
                    "address": {
                        "socket_address": {"address": "127.0.0.1", "port_value": listen_port}
                    },
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


def test_envoy_proxies_to_local_upstream(
    processes: ProcessGroup, envoy_binary: Path, tmp_path: Path
) -> None:
    upstream_port, listen_port, admin_port = free_port(), free_port(), free_port()
    (tmp_path / "hello.txt").write_text("hello through envoy\n")
    processes.start(
        "upstream",
        [sys.executable, "-m", "http.server", str(upstream_port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        ready=tcp_ready("127.0.0.1", upstream_port),
        timeout=20,
    )
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(static_envoy_config(listen_port, admin_port, upstream_port)))
    processes.start(
        "envoy",
        [
            str(envoy_binary),
            "-c",
            str(config),
            "--log-level",
            "warn",
            "--concurrency",
            "1",
            "--base-id",
            str(admin_port),
        ],
        ready=http_ready(f"http://127.0.0.1:{admin_port}/ready"),
        timeout=60,
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{listen_port}/hello.txt", timeout=10) as resp:
        assert resp.status == 200
        assert resp.read() == b"hello through envoy\n"
        assert resp.headers["server"] == "envoy"
