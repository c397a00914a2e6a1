"""``infergate envoy-drain`` (infergate.envoy.drain) against a real Envoy, run with a
Gateway proxy's drain arguments: ``GET /shutdown`` fails Envoy's health check, keeps its
listeners accepting, closes each connection after its response, and answers only once no
connection is left."""

from __future__ import annotations

import http.client
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from infergate.envoy import find_envoy
from infergate.envoy.process import write_config
from infergate.gateway.bootstrap import gateway_proxy_args
from infergate.procs import ProcessGroup, free_port, http_ready

pytestmark = pytest.mark.timeout(120)


def _bootstrap(admin: int, listen: int) -> dict[str, object]:
    route = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 200, "body": {"inline_string": "ok"}},
    }
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "drain_test",
            "route_config": {
                "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]
            },
            "http_filters": [
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                    },
                }
            ],
        },
    }
    address = {"socket_address": {"address": "127.0.0.1", "port_value": listen}}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {"name": "http", "address": address, "filter_chains": [{"filters": [hcm]}]}
            ]
        },
    }


@pytest.fixture
def envoy_and_drainer(tmp_path: Path) -> Iterator[tuple[int, int, int]]:
    """A Gateway-style Envoy (``--drain-strategy immediate``) and its drainer: (listener
    port, admin port, drainer port)."""
    admin, listen, port = free_port(), free_port(), free_port()
    config = write_config(_bootstrap(admin, listen), tmp_path / "envoy.yaml")
    args = gateway_proxy_args(config, bind_address=None, concurrency=1, log_level="warn")
    group = ProcessGroup()
    try:
        group.start(
            "envoy", [str(find_envoy()), *args], ready=http_ready(f"http://127.0.0.1:{admin}/ready")
        )
        group.start(
            "drain",
            [sys.executable, "-m", "infergate.cli", "envoy-drain", "--admin-url",
             f"http://127.0.0.1:{admin}", "--port", str(port), "--min-drain-s", "0.5",
             "--drain-timeout-s", "60", "--poll-s", "0.1"],
            ready=http_ready(f"http://127.0.0.1:{port}/healthz"),
        )  # fmt: skip
        yield listen, admin, port
    finally:
        group.stop_all()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_shutdown_drains_envoy_and_answers_once_no_connection_is_left(
    envoy_and_drainer: tuple[int, int, int],
) -> None:
    listen, admin, port = envoy_and_drainer
    held = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
    held.request("GET", "/")
    first = held.getresponse()
    assert (first.status, first.read(), first.getheader("connection")) == (200, b"ok", None)

    answered: list[int] = []
    shutdown = threading.Thread(target=lambda: answered.append(_status(
        f"http://127.0.0.1:{port}/shutdown")))  # fmt: skip
    shutdown.start()
    # Draining: Envoy says it is not ready, yet its listener still takes new connections...
    while _status(f"http://127.0.0.1:{admin}/ready") != 503:
        time.sleep(0.05)
    assert _status(f"http://127.0.0.1:{listen}/") == 200
    # ...and the drain waits for the connection that is still open.
    shutdown.join(timeout=2)
    assert shutdown.is_alive() and not answered
    # Its next response closes it; then nothing is left and /shutdown answers.
    held.request("GET", "/")
    last = held.getresponse()
    assert (last.status, last.read(), last.getheader("connection")) == (200, b"ok", "close")
    held.close()
    shutdown.join(timeout=60)
    assert answered == [200]
