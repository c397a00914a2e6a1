"""ext-proc over TLS end to end: the EPP's --secure-serving and the Envoy config we generate.

A matching pair routes as usual; a plaintext Envoy in front of a TLS EPP sees the EPP as
unhealthy (gRPC health on the ext-proc port, same transport) and fails fast and visibly
(FailClose: 5xx at once), instead of a health check saying healthy while every request fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from infergate.envoy.bootstrap import EPP_CLUSTER
from infergate.envoy.process import start_envoy
from infergate.procs import free_port
from infergate.stack.local import LocalStack, StackSpec
from infergate.stack.probes import envoy_cluster_healthy


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=1,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        secure_serving=True,
        workdir=tmp_path_factory.mktemp("tls-stack"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as stack:
        yield stack


def _eventually(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def _completion(base_url: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": "hello over tls", "max_tokens": 4},
        timeout=30,
    )


def _epp_healthy(admin_port: int) -> bool:
    return envoy_cluster_healthy(f"http://127.0.0.1:{admin_port}", EPP_CLUSTER)


def test_tls_epp_behind_tls_envoy_routes(tls_stack: LocalStack) -> None:
    response = _completion(tls_stack.base_url)
    assert response.status_code == 200, response.text
    assert response.headers["x-infergate-picked-endpoint"] == tls_stack.engine_addresses[0]
    assert _epp_healthy(tls_stack.spec.admin_port)


def test_plaintext_envoy_against_tls_epp_is_unhealthy_not_silent(
    tls_stack: LocalStack, tmp_path: Path
) -> None:
    port, admin = free_port(), free_port()
    config = tls_stack.envoy_config(
        epp_tls=False, listen_port=port, admin_port=admin, access_log=False
    )
    envoy = start_envoy(
        tls_stack.group, config, tmp_path / "plain.yaml", log_path=tmp_path / "plain.log"
    )
    try:
        assert _eventually(
            lambda: "/failed_active_hc" in httpx.get(f"http://127.0.0.1:{admin}/clusters").text
        )
        assert not _epp_healthy(admin)
        response = _completion(f"http://127.0.0.1:{port}")
        assert response.status_code >= 500  # FailClose: fast and visible
    finally:
        envoy.stop()
        tls_stack.group.processes.remove(envoy)
