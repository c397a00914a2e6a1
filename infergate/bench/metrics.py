"""Serving metrics with ``vllm bench serve``'s definitions, so figures compare one to one.

Per successful request: TTFT = first token's arrival − send time; E2E latency = last
token's arrival − send time; TPOT = (E2E − TTFT) / (output tokens − 1), only for requests
with more than one output token; ITL = the gaps between consecutive streamed chunks,
pooled over all requests. Throughputs divide by the benchmark's wall-clock duration:
requests/s counts completed requests; output tokens/s sums the server-reported
completion tokens; total tokens/s adds the prompt tokens. Goodput counts requests that
meet every given SLO (ms). Aggregates are mean, median, std and chosen percentiles, in ms
(numpy's linear-interpolation percentiles, as vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestResult:
    """What the client saw for one request (times in seconds)."""

    success: bool
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    status: int | None = None


def arrival_times(
    n: int, request_rate: float, burstiness: float = 1.0, *, seed: int = 0
) -> list[float]:
    """Send offsets (s from start) for ``n`` requests: Poisson at ``request_rate`` when
    burstiness is 1, gamma-distributed gaps otherwise (lower = burstier), all at 0 for an
    infinite rate. Rescaled so the last one lands at n / rate, as vLLM does, which keeps
    the achieved rate on target whatever the seed."""
    if n <= 0:
        return []
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    times *= (n / request_rate) / times[-1]
    return [float(t) for t in times]


def _label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _stats(name: str, values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    data = np.asarray(values if len(values) else [0.0], dtype=float) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(data)),
        f"median_{name}_ms": float(np.median(data)),
        f"std_{name}_ms": float(np.std(data)),
    }
    for p in percentiles:
        out[f"p{_label(p)}_{name}_ms"] = float(np.percentile(data, p))
    return out


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, float | int]:
    """The summary figures (vLLM's key names) for one benchmark run."""
    if duration_s <= 0:
        raise ValueError("duration must be > 0")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p} is outside [0, 100]")
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)

    good = 0
    if goodput_slos_ms:
        unknown = set(goodput_slos_ms) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"goodput SLOs are ttft, tpot, e2el; not {sorted(unknown)}")
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            seen = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            if all(seen[k] * 1000.0 <= slo for k, slo in goodput_slos_ms.items()):
                good += 1

    metrics: dict[str, float | int] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    if goodput_slos_ms:
        metrics["request_goodput"] = good / duration_s
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats(name, values, percentiles))
    return metrics


def peak_concurrency(results: Iterable[RequestResult]) -> int:
    """Most requests in flight at once (half-open [start, end) intervals)."""
    events = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    events.sort()  # at equal times -1 sorts first: a departure frees its slot first
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def format_summary(
    metrics: dict[str, float | int], *, percentiles: Sequence[float] = (50, 90, 99)
) -> str:
    """A fixed-width text summary in the layout ``vllm bench serve`` users know; a run cut
    short by Ctrl-C (``partial``) says so and counts the requests it did not finish."""
    width = 50
    partial = bool(metrics.get("partial"))
    title = " Serving Benchmark Result (partial) " if partial else " Serving Benchmark Result "
    lines = [title.center(width, "=")]

    def row(label: str, value: float | int, fmt: str = ".2f") -> None:
        text = f"{value:{fmt}}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", int(metrics["completed"]))
    row("Failed requests:", int(metrics["failed"]))
    if partial:
        finished = int(metrics["completed"]) + int(metrics["failed"])
        row("Unfinished requests (interrupted):", int(metrics["num_prompts"]) - finished)
    row("Benchmark duration (s):", float(metrics["duration"]))
    row("Total input tokens:", int(metrics["total_input_tokens"]))
    row("Total generated tokens:", int(metrics["total_output_tokens"]))
    row("Request throughput (req/s):", float(metrics["request_throughput"]))
    if "request_goodput" in metrics:
        row("Request goodput (req/s):", float(metrics["request_goodput"]))
    row("Output token throughput (tok/s):", float(metrics["output_throughput"]))
    row("Total token throughput (tok/s):", float(metrics["total_token_throughput"]))
    row("Peak concurrent requests:", int(metrics["max_concurrent_requests"]))
    for name in METRICS:
        lines.append(f" {_TITLES[name]} ".center(width, "-"))
        short = name.upper()
        row(f"Mean {short} (ms):", float(metrics[f"mean_{name}_ms"]))
        row(f"Median {short} (ms):", float(metrics[f"median_{name}_ms"]))
        for p in percentiles:
            if p == 50:  # already shown as the median
                continue
            row(f"P{_label(p)} {short} (ms):", float(metrics[f"p{_label(p)}_{name}_ms"]))
    lines.append("=" * width)
    return "\n".join(lines)
