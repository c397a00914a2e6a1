"""The workload matrix's trace family: shipped-trace windows by seed and bursty synthetic
traces shaped like it (bursts, heavy-tailed lengths, conversations sharing prefixes)."""

from __future__ import annotations

import pytest

from infergate.bench.routing import matrix, traces


def test_bursty_traces_come_in_bursts_with_trace_like_lengths_and_shared_prefixes() -> None:
    trace = matrix.bursty_trace(1)
    assert trace == matrix.bursty_trace(1) and trace != matrix.bursty_trace(2)  # seeded
    stamps: dict[float, int] = {}
    for request in trace:
        stamps[request.timestamp_ms] = stamps.get(request.timestamp_ms, 0) + 1
        assert request.input_length <= matrix.CONTEXT_TOKENS
        assert len(request.hash_ids) == -(-request.input_length // traces.TRACE_BLOCK_TOKENS)
    low, high = matrix.BURST_SIZES
    assert all(low <= n <= high for n in stamps.values())
    assert 0.5 * matrix.BURST_RATE < len(trace) / matrix.TRACE_SECONDS < 2 * matrix.BURST_RATE
    lengths = sorted(r.input_length for r in trace)
    p50, p90 = lengths[len(lengths) // 2], lengths[int(0.9 * len(lengths))]
    assert p90 > 2.5 * p50  # heavy-tailed, as the shipped trace (p50 ~12k, p90 ~40k)
    assert 0.2 < traces.prefix_ceiling(trace) < 0.8  # conversations and system prompts


def test_trace_cells_are_windows_by_seed_and_bursty_traces_on_the_h100_profile() -> None:
    cells = matrix.select("trace", None)
    assert [c.name for c in cells] == [
        "trace-window-s7", "trace-window-s46", "trace-window-s2",
        "trace-bursty-s1", "trace-bursty-s2",
    ]  # fmt: skip
    if not matrix.SHIPPED_TRACE.exists():
        pytest.skip("the shipped trace is not beside this checkout")
    window = matrix.TraceCell("window", 46)
    trace, chosen = window.requests()
    assert chosen == traces.window_for_seed(trace, matrix.TRACE_SECONDS, 46)
    work = matrix.workload(window)
    assert work.num_prompts == len(traces.in_window(trace, chosen)) == len(work.arrivals)
    assert f"--sim-profile={matrix.TRACE_PROFILE}" in work.engine_args
    bursty = matrix.workload(matrix.TraceCell("bursty", 1))
    assert bursty.num_prompts == len(matrix.bursty_trace(1))
    with pytest.raises(ValueError, match="window or bursty"):
        matrix.TraceCell("other", 1).workload()
