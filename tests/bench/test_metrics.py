"""Metric math of ``infergate bench serve`` on recorded timings, against vLLM's definitions."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from infergate.bench.metrics import (
    RequestResult,
    arrival_times,
    compute_metrics,
    format_summary,
    peak_concurrency,
)


def _result(start: float, ttft: float, itl: list[float], tokens: int, prompt: int) -> RequestResult:
    return RequestResult(
        success=True,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        output_tokens=tokens,
        prompt_len=prompt,
    )


RECORDED = [
    # 4 tokens: first at 100 ms, then gaps of 10, 20, 30 ms -> E2E 160 ms, TPOT 20 ms.
    _result(0.0, 0.100, [0.010, 0.020, 0.030], 4, 50),
    # 2 tokens: first at 200 ms, one gap of 40 ms -> E2E 240 ms, TPOT 40 ms.
    _result(0.05, 0.200, [0.040], 2, 70),
    # 1 token: no TPOT (vLLM skips single-token requests), E2E = TTFT = 300 ms.
    _result(1.0, 0.300, [], 1, 30),
    RequestResult(success=False, error="HTTP 429", status=429),
]


def test_latencies_follow_vllm_definitions() -> None:
    m = compute_metrics(RECORDED, duration_s=2.0, percentiles=[50, 90, 99])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["mean_ttft_ms"] == pytest.approx((100 + 200 + 300) / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    # TPOT = (E2E - TTFT) / (tokens - 1): (60/3 + 40/1) / 2 requests
    assert m["mean_tpot_ms"] == pytest.approx((20 + 40) / 2)
    # ITL pools every gap of every request
    gaps = [10, 20, 30, 40]
    assert m["mean_itl_ms"] == pytest.approx(statistics.mean(gaps))
    assert m["p90_itl_ms"] == pytest.approx(float(np.percentile(gaps, 90)))
    assert m["std_itl_ms"] == pytest.approx(statistics.pstdev(gaps))
    e2e = [160, 240, 300]
    assert m["p99_e2el_ms"] == pytest.approx(float(np.percentile(e2e, 99)))
    assert m["median_e2el_ms"] == pytest.approx(240)


def test_throughputs_count_only_successful_requests() -> None:
    m = compute_metrics(RECORDED, duration_s=2.0)
    assert m["total_input_tokens"] == 50 + 70 + 30
    assert m["total_output_tokens"] == 4 + 2 + 1
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    assert m["output_throughput"] == pytest.approx(7 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((150 + 7) / 2.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    # TTFT <= 250 ms keeps the first two; TPOT <= 30 ms then keeps only the first.
    m = compute_metrics(RECORDED, duration_s=2.0, goodput_slos_ms={"ttft": 250, "tpot": 30})
    assert m["request_goodput"] == pytest.approx(1 / 2.0)
    with pytest.raises(ValueError, match="goodput"):
        compute_metrics(RECORDED, duration_s=2.0, goodput_slos_ms={"itl": 5})


def test_no_successes_gives_zeros_not_errors() -> None:
    m = compute_metrics([RequestResult(success=False)], duration_s=1.0)
    assert m["completed"] == 0
    assert m["mean_ttft_ms"] == 0.0
    assert m["request_throughput"] == 0.0


def test_peak_concurrency_uses_half_open_intervals() -> None:
    back_to_back = [_result(0.0, 1.0, [], 1, 1), _result(1.0, 1.0, [], 1, 1)]
    assert peak_concurrency(back_to_back) == 1
    overlapping = [*back_to_back, _result(0.5, 1.0, [], 1, 1)]
    assert peak_concurrency(overlapping) == 2


def test_poisson_arrivals_hit_the_rate_and_burstiness_shapes_gaps() -> None:
    times = arrival_times(2000, request_rate=50.0, burstiness=1.0, seed=1)
    assert times == sorted(times)
    assert times[-1] == pytest.approx(2000 / 50.0)  # rescaled onto the target rate
    gaps = np.diff([0.0, *times])
    # Exponential gaps: coefficient of variation ~1; gamma(shape 0.25): ~2 (burstier).
    assert 0.85 < gaps.std() / gaps.mean() < 1.15
    bursty = np.diff([0.0, *arrival_times(2000, 50.0, burstiness=0.25, seed=1)])
    assert bursty.std() / bursty.mean() > 1.6
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    even = arrival_times(4, 2.0, burstiness=float("inf"))
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0)


def test_summary_lists_every_metric_section() -> None:
    m = compute_metrics(RECORDED, duration_s=2.0, percentiles=[90, 99])
    text = format_summary(m, percentiles=[90, 99])
    for label in ("TTFT", "TPOT", "ITL", "E2EL", "Request throughput", "P99 ITL (ms)"):
        assert label in text
    assert f"{m['mean_ttft_ms']:.2f}" in text
