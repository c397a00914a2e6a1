"""``infergate up --request-body-mode buffered`` through the real Envoy: Envoy buffers each
request body and sends it to the EPP once; the EPP's answer carries the pick and leaves
the body as it is (or replaces it when a model rewrite changed it). Requests are served
by the engine the EPP picked, streamed or not; a body over the EPP's limit gets its 413,
one over Envoy's buffer Envoy's 413; a malformed one gets the EPP's 400."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.envoy.bootstrap import PICKED_HEADER, SERVED_HEADER, UPSTREAM_HOST_HEADER
from infergate.stack.local import LocalStack, StackSpec

REWRITE_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: alias}
spec:
  rules:
  - matches: [{model: {value: tiny-alias}}]
    targets: [{modelRewrite: tiny, weight: 1}]
"""
MAX_BODY = 2 << 20  # over Envoy's default per-request buffer (1 MiB), as the EPP's


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("buffered")
    objectives = workdir / "objectives.yaml"
    objectives.write_text(REWRITE_YAML)
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        request_body_mode="buffered",
        objectives_file=objectives,
        epp_args=["--max-request-body-bytes", str(MAX_BODY)],
        access_log=False,
        workdir=workdir,
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


def _post(stack: LocalStack, body: dict | bytes, **kwargs: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{stack.base_url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
        **kwargs,  # type: ignore[arg-type]
    )


def test_requests_reach_the_picked_engine(stack: LocalStack) -> None:
    prompt = "a shared system prompt " * 100
    served = set()
    for i in range(6):
        reply = _post(stack, {"model": "tiny", "prompt": f"{prompt}{i}", "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        picked = reply.headers[PICKED_HEADER].split(",")[0]
        assert reply.headers[UPSTREAM_HOST_HEADER] == picked
        assert reply.headers[SERVED_HEADER] == picked  # Envoy's: the EPP skipped the headers
        served.add(picked)
    assert len(served) == 1  # one shared prefix: the prefix scorer keeps it on one engine


def test_a_streamed_generation_arrives_whole(stack: LocalStack) -> None:
    body = {"model": "tiny", "prompt": "count", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) >= 9  # 8 tokens (one event each) and [DONE]


def test_a_rewritten_model_reaches_the_engine_in_the_body(stack: LocalStack) -> None:
    reply = _post(stack, {"model": "tiny-alias", "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "tiny"


def test_bodies_over_envoys_default_buffer_pass(stack: LocalStack) -> None:
    """1.5 MiB: past Envoy's default 1 MiB per-request buffer, under the configured limit,
    so it reaches the EPP and the engine (which refuses a prompt that long itself)."""
    reply = _post(stack, {"model": "tiny", "prompt": "x" * (3 << 19), "max_tokens": 1})
    assert reply.status_code != 413, reply.text
    assert reply.headers.get(PICKED_HEADER), reply.text  # the EPP routed it


def test_bad_bodies_get_clear_errors(stack: LocalStack) -> None:
    over_epp = _post(stack, b'{"model": "tiny", "prompt": "' + b"x" * (MAX_BODY + 10) + b'"}')
    assert over_epp.status_code == 413
    assert "exceeds" in over_epp.json()["error"]["message"]  # the EPP's limit
    # Past Envoy's buffer (EnvoyConfig.max_request_body_bytes, 8 MiB by default): Envoy
    # answers before the EPP sees anything.
    over_envoy = _post(stack, b'{"model": "tiny", "prompt": "' + b"x" * (9 << 20) + b'"}')
    assert over_envoy.status_code == 413
    assert PICKED_HEADER not in over_envoy.headers
    malformed = _post(stack, b'{"model": "tiny", "prompt": ')
    assert malformed.status_code == 400
    assert "not valid JSON" in malformed.json()["error"]["message"]


def _epp_sum(stack: LocalStack, prefix: str) -> float:
    """The sum of the EPP's samples whose line starts with ``prefix``."""
    text = httpx.get(stack.epp_metrics_url, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


IN_FLIGHT = "infergate_epp_endpoint_in_flight_requests{"
COMPLETION_TOKENS = 'infergate_epp_tokens_total{kind="completion"}'
ERRORS = "inference_objective_request_error_total{"


def test_without_response_headers_the_record_ends_the_request(stack: LocalStack) -> None:
    """Every engine reports records, so the EPP skips the response headers. Envoy keeps
    the routing stream until the response ends (so the request counts as in flight while
    it streams), and the engine's record gives the EPP the status and the tokens: no
    error counted for an unknown status."""
    tokens, errors = _epp_sum(stack, COMPLETION_TOKENS), _epp_sum(stack, ERRORS)
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    seen_in_flight = 0.0
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and seen_in_flight == 0.0:
                seen_in_flight = _epp_sum(stack, IN_FLIGHT)
    assert seen_in_flight == 1.0
    deadline = time.monotonic() + 10
    while _epp_sum(stack, IN_FLIGHT) != 0.0:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.1)
    assert _epp_sum(stack, COMPLETION_TOKENS) == tokens + 200
    assert _epp_sum(stack, ERRORS) == errors
