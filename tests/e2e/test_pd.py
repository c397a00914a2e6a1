"""Prefill/decode disaggregation end to end: real Envoy, the EPP's P/D profiles, real
engines on the tiny model handing KV over their ZMQ connector.

engine-0 is a prefill engine (``llm-d.ai/role: prefill``, ``kv_producer``), engine-1 a
decode engine (``kv_consumer``). Long prompts are disaggregated (the EPP names engine-0
in ``x-prefiller-host-port``; engine-1 asks it to prefill, pulls the KV, decodes), short
ones are not; the greedy text equals what one engine alone produces; and with the
prefill engine dead, requests still succeed (local prefill).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infergate.stack.local import LocalStack, StackSpec

THRESHOLD = 64
LONG = "The quick brown fox jumps over the lazy dog near the riverbank. " * 24
SHORT = "Hello there"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=False,
        roles=["prefill", "decode"],
        pd_threshold=THRESHOLD,
        engine_args=["--device", "cpu", "--max-num-seqs", "4"],
        access_log=False,
        workdir=tmp_path_factory.mktemp("pd"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            outcome = sample.labels.get("outcome") or sample.labels.get("decision")
            out[sample.name + (f":{outcome}" if outcome else "")] = sample.value
    return out


def epp_decisions(stack: LocalStack, decision: str) -> float:
    return counters(stack.epp_metrics_url.removesuffix("/metrics")).get(
        f"infergate_epp_pd_decisions_total:{decision}", 0.0
    )


def complete(
    base_url: str, prompt: str, max_tokens: int = 12, timeout: float = 120.0
) -> openai.types.Completion:
    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=timeout
    )
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0
    )


def test_long_prompt_is_disaggregated_and_matches_one_engine(stack: LocalStack) -> None:
    prefill_url, decode_url = stack.engine_urls
    p0, d0 = counters(prefill_url), counters(decode_url)
    split = epp_decisions(stack, "disaggregated")
    through_gateway = complete(stack.base_url, LONG)
    p1, d1 = counters(prefill_url), counters(decode_url)
    assert epp_decisions(stack, "disaggregated") == split + 1
    assert p1["infergate:kv_transfer_prefills_held_total:pulled"] == (
        p0["infergate:kv_transfer_prefills_held_total:pulled"] + 1
    )
    assert d1["infergate:kv_transfer_remote_prefills_total:pulled"] == (
        d0["infergate:kv_transfer_remote_prefills_total:pulled"] + 1
    )
    assert (
        d1["infergate:kv_transfer_injected_tokens_total"]
        > d0["infergate:kv_transfer_injected_tokens_total"]
    )
    # The same request on the prefill engine alone (an ordinary request there).
    alone = complete(prefill_url, LONG)
    assert through_gateway.choices[0].text == alone.choices[0].text
    # The decode engine now holds the prompt's KV: a direct request is a prefix hit.
    again = complete(decode_url, LONG)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= again.usage.prompt_tokens - 16
    assert again.choices[0].text == alone.choices[0].text
    # Nothing stays held on the prefill engine.
    assert counters(prefill_url)["infergate:kv_transfer_held_blocks"] == 0


def test_short_prompt_is_not_disaggregated(stack: LocalStack) -> None:
    prefill_url = stack.engine_urls[0]
    before = counters(prefill_url)["infergate:kv_transfer_prefills_held_total:held"]
    local = epp_decisions(stack, "local")
    out = complete(stack.base_url, SHORT)
    assert epp_decisions(stack, "local") == local + 1
    assert out.choices[0].text
    after = counters(prefill_url)["infergate:kv_transfer_prefills_held_total:held"]
    assert after == before


def test_client_cannot_pick_the_prefill_engine(stack: LocalStack) -> None:
    """The EPP owns x-prefiller-host-port: a client's value never reaches the engine."""
    _, decode_url = stack.engine_urls
    before = counters(decode_url)
    response = httpx.post(
        f"{stack.base_url}/v1/completions",
        json={"model": "tiny", "prompt": SHORT, "max_tokens": 4, "temperature": 0},
        headers={"x-prefiller-host-port": "127.0.0.1:1"},
        timeout=60,
    )
    assert response.status_code == 200
    after = counters(decode_url)
    assert (
        after["infergate:kv_transfer_remote_prefills_total:fallback"]
        == (before["infergate:kv_transfer_remote_prefills_total:fallback"])
    )


def test_bad_kv_transfer_params_are_400(stack: LocalStack) -> None:
    _, decode_url = stack.engine_urls
    response = httpx.post(
        f"{decode_url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": SHORT,
            "max_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_port": "x"},
        },
        timeout=60,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and "remote" in error["message"]
    response = httpx.post(
        f"{decode_url}/v1/completions",
        json={"model": "tiny", "prompt": SHORT, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    )
    assert response.status_code == 400  # a kv_consumer does not hold KV for others
    assert "kv_consumer" in response.json()["error"]["message"]


def test_hung_prefill_engine_leaves_the_prefill_profile(stack: LocalStack) -> None:
    """A prefill engine that accepts connections and never answers (SIGSTOP: the kernel
    still completes TCP handshakes) is not named to the decode engine once its metrics go
    stale, so no request waits on the decode engine's KV pull timeout (60 s)."""
    prefill, _ = stack.engines
    _, decode_url = stack.engine_urls
    os.killpg(prefill.pid, signal.SIGSTOP)
    try:
        time.sleep(3.5)  # the EPP's scrapes time out (1 s); past 2 s its metrics are stale
        local_before = epp_decisions(stack, "local")
        remote_before = sum(
            v for k, v in counters(decode_url).items()
            if k.startswith("infergate:kv_transfer_remote_prefills_total")
        )  # fmt: skip
        for i in range(3):
            out = complete(stack.base_url, f"hung {i} {LONG}", timeout=30.0)
            assert out.usage is not None and out.usage.completion_tokens == 12
        remote_after = sum(
            v for k, v in counters(decode_url).items()
            if k.startswith("infergate:kv_transfer_remote_prefills_total")
        )  # fmt: skip
        assert remote_after == remote_before  # the decode engine never asked the hung one
        assert epp_decisions(stack, "local") == local_before + 3
    finally:
        os.killpg(prefill.pid, signal.SIGCONT)
    # Awake again, it is back in the prefill profile once the EPP has fresh metrics.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        before = epp_decisions(stack, "disaggregated")
        complete(stack.base_url, f"awake {time.monotonic()} {LONG}")
        if epp_decisions(stack, "disaggregated") > before:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the resumed prefill engine never rejoined the prefill profile")


def test_dead_prefill_engine_does_not_fail_requests(stack: LocalStack) -> None:
    """Last in the module: it stops the prefill engine for good."""
    prefill, _ = stack.engines
    _, decode_url = stack.engine_urls
    prefill.stop()
    before = counters(decode_url)["infergate:kv_transfer_remote_prefills_total:fallback"]
    for i in range(3):
        out = complete(stack.base_url, f"{i} {LONG}")
        assert out.choices[0].finish_reason == "length"
        assert out.usage is not None and out.usage.completion_tokens == 12
    after = counters(decode_url)["infergate:kv_transfer_remote_prefills_total:fallback"]
    assert after >= before + 1  # at least the first one tried the dead engine and fell back
