"""``infergate up --precise-prefix``'s wiring: engines publish KV events, the EPP routes on
them, and requests sharing a long prefix stick to the engine that really caches it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.envoy.bootstrap import UPSTREAM_HOST_HEADER
from infergate.procs import free_port
from infergate.stack.local import LocalStack, StackSpec
from tests.support.probes import metric_sum, wait_for


@pytest.fixture(scope="module")
def precise_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        simulate=True,
        precise_prefix=True,
        kv_events_ports=[free_port(), free_port()],
        workdir=tmp_path_factory.mktemp("precise"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as stack:
        yield stack


def test_shared_prefix_follows_the_engines_kv_events(precise_stack: LocalStack) -> None:
    stack = precise_stack
    assert stack.workdir is not None
    config = (stack.workdir / "epp-config.yaml").read_text()
    assert "precise-prefix-cache-scorer" in config
    assert "infergate.io/kv-events-port" in stack.endpoints_file.read_text()

    def stored_events() -> float:
        return metric_sum(stack.epp_metrics_url, "infergate_epp_kv_events_total")

    before = stored_events()
    system = f"Policy {uuid.uuid4()}: " + "answer briefly and cite the handbook. " * 60
    first = httpx.post(
        f"{stack.base_url}/v1/completions",
        json={"model": stack.model_name, "prompt": f"{system}\nQ0?", "max_tokens": 2},
        timeout=60,
    )
    assert first.status_code == 200
    home = first.headers[UPSTREAM_HOST_HEADER]
    # The engine announces the blocks it stored; the EPP indexes them.
    wait_for(lambda: stored_events() > before, 30, "the EPP to receive KV events")
    served = {
        httpx.post(
            f"{stack.base_url}/v1/completions",
            json={"model": stack.model_name, "prompt": f"{system}\nQ{i}?", "max_tokens": 2},
            timeout=60,
        ).headers[UPSTREAM_HOST_HEADER]
        for i in range(1, 7)
    }
    assert served == {home}


API_KEY = "e2e-engine-key"


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    """Engines on ``--api-key`` behind GIE's profile with the precise scorer alone (no
    approximate prefix scorer to stand in for it): ``up`` must hand the EPP the key."""
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        simulate=True,
        precise_prefix=True,
        kv_events_ports=[free_port(), free_port()],
        epp_config_file=Path("builtin:gie-precise-prefix"),
        engine_args=[f"--api-key={API_KEY}"],
        workdir=tmp_path_factory.mktemp("precise-keyed"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as stack:
        yield stack


def test_precise_prefix_scores_hits_with_engine_api_key(keyed_stack: LocalStack) -> None:
    stack = keyed_stack
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def stored_events() -> float:
        return metric_sum(stack.epp_metrics_url, "infergate_epp_kv_events_total")

    def post(prompt: str) -> httpx.Response:
        body = {"model": stack.model_name, "prompt": prompt, "max_tokens": 2}
        return httpx.post(f"{stack.base_url}/v1/completions", json=body, headers=auth, timeout=60)

    before = stored_events()
    system = f"Policy {uuid.uuid4()}: " + "answer briefly and cite the handbook. " * 60
    first = post(f"{system}\nQ0?")
    assert first.status_code == 200, first.text
    home = first.headers[UPSTREAM_HOST_HEADER]
    wait_for(lambda: stored_events() > before, 30, "the EPP to receive KV events")
    served = [post(f"{system}\nQ{i}?") for i in range(1, 11)]
    assert [r.status_code for r in served] == [200] * 10
    # Only the precise scorer tells the two idle engines apart: 10 of 10 on the engine
    # holding the prefix (chance: 1 in 1024), and no /tokenize was refused.
    assert {r.headers[UPSTREAM_HOST_HEADER] for r in served} == {home}
    assert metric_sum(stack.epp_metrics_url, "infergate_epp_tokenize_errors_total") == 0
