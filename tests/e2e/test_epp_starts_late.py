"""An Envoy that starts before its EPP learns the pool soon after the EPP is ready.

The sidecar Envoy's EDS stream to the EPP fails while the EPP is down and is redialled
with a backoff. With Envoy's default (0.5 s doubling to 30 s) an Envoy up 18-31 s before
its EPP learnt the pool 10-21 s after the EPP was ready, answering 503 "no healthy
upstream" until then; the bootstrap's ``EDS_RECONNECT`` bounds the redial to 1 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from infergate.envoy.bootstrap import POOL_CLUSTER
from infergate.envoy.process import start_envoy
from infergate.stack.local import LocalStack, StackSpec
from tests.support.probes import envoy_cluster_hosts, wait_for

#: How long Envoy runs alone: long enough for the default backoff to reach ~8-16 s.
ALONE_S = 12.0
#: How soon after the EPP is ready the pool must be known and a request served: the
#: redial interval (1 s) plus the EPP's first EDS answer, with room for a loaded machine;
#: Envoy's default backoff would be ~8-16 s here.
DEADLINE_S = 6.0


def _pool_hosts(admin: str) -> set[str]:
    return set(envoy_cluster_hosts(admin, POOL_CLUSTER))


def test_envoy_started_first_learns_the_pool_once_the_epp_is_up(
    tmp_path: Path, tiny_model: Path
) -> None:
    spec = StackSpec.on_free_ports(
        engines=2, model=tiny_model, served_model_name="tiny", simulate=True, workdir=tmp_path
    )
    stack = LocalStack(spec)
    try:
        stack.start_engines()  # the engines, but neither the EPP nor Envoy yet
        stack.write_endpoints(stack.engine_addresses)
        assert stack.workdir is not None
        stack.envoy = start_envoy(
            stack.group,
            stack.envoy_config(),
            stack.envoy_config_file,
            log_path=stack.workdir / "envoy.log",
        )
        admin = f"http://127.0.0.1:{spec.admin_port}"
        time.sleep(ALONE_S)
        assert _pool_hosts(admin) == set()  # nothing to learn from yet
        request = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        refused = httpx.post(f"{stack.base_url}/v1/completions", json=request, timeout=30)
        assert refused.status_code >= 500  # FailClose: no EPP, no pick

        stack.start_epp(0)
        wait_for(
            lambda: _pool_hosts(admin) == set(stack.engine_addresses),
            DEADLINE_S,
            "Envoy to redial the EPP's EDS and learn both engines",
        )
        served = httpx.post(f"{stack.base_url}/v1/completions", json=request, timeout=30)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["text"]
    finally:
        stack.stop()
