"""Drive a whole serving benchmark: arrivals, concurrency cap, progress bar, results."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from infergate.bench.client import build_payload, send_request
from infergate.bench.datasets import SampleRequest
from infergate.bench.metrics import RequestResult, arrival_times, compute_metrics


@dataclass
class BenchConfig:
    base_url: str
    samples: Sequence[SampleRequest]
    endpoint: str = "/v1/completions"
    model: str | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    #: Send offsets (s from the start), one per sample, instead of ``request_rate``'s
    #: arrivals (a replayed trace's timestamps).
    arrivals: Sequence[float] | None = None
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] | None = None
    percentiles: Sequence[float] = (50, 90, 99)
    goodput_slos_ms: dict[str, float] | None = None
    request_timeout_s: float = 600.0
    progress: bool = True


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_benchmark`'s requests. ``result`` is the run's result over
    the requests that had finished (``"partial": True``), for a partial summary. A
    ``KeyboardInterrupt``, so a caller that does not look for it stops as it always did."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("benchmark interrupted")
        self.result = result


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists (``vllm bench serve``'s default)."""
    async with session.get(f"{base_url}/v1/models") as response:
        if response.status != 200:
            raise RuntimeError(
                f"GET {base_url}/v1/models answered {response.status}: "
                f"{(await response.text())[:300]}; pass --model"
            )
        data = await response.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Send every sample, then return metrics plus per-request detail (vLLM's JSON keys)."""
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    base = config.base_url.rstrip("/")
    url = base + config.endpoint
    limit = config.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = config.model or await first_model(session, base)
        offsets = (
            list(config.arrivals)
            if config.arrivals is not None
            else arrival_times(
                len(config.samples), config.request_rate, config.burstiness, seed=config.seed
            )
        )
        if len(offsets) != len(config.samples):
            raise ValueError(f"{len(offsets)} arrival times for {len(config.samples)} samples")
        # How late each request left against its arrival time: a client that cannot keep
        # the schedule (a busy machine) shows here, not as the router's latency.
        send_lags = [0.0] * len(config.samples)
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        bar = tqdm(total=len(config.samples), disable=not config.progress, unit="req")

        async def one(index: int, sample: SampleRequest) -> RequestResult:
            payload = build_payload(
                sample,
                endpoint=config.endpoint,
                model=model,
                ignore_eos=config.ignore_eos,
                temperature=config.temperature,
                extra_body=config.extra_body,
            )
            send_lags[index] = time.perf_counter() - (started + offsets[index])
            if gate is None:
                result = await send_request(
                    session, url, payload, prompt_len=sample.prompt_len, headers=config.headers
                )
            else:
                async with gate:
                    result = await send_request(
                        session,
                        url,
                        payload,
                        prompt_len=sample.prompt_len,
                        headers=config.headers,
                    )
            bar.update(1)
            return result

        started = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        try:
            for index, (sample, offset) in enumerate(zip(config.samples, offsets, strict=True)):
                delay = started + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(index, sample)))
            results = await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels us): what finished
            bar.close()
            done = [i for i, t in enumerate(tasks) if t.done() and not t.cancelled()]
            finished = [tasks[i].result() for i in done if tasks[i].exception() is None]
            lags = [send_lags[i] for i in done if tasks[i].exception() is None]
            duration = time.perf_counter() - started
            result = _result(config, base, model, finished, duration, lags)
            raise Interrupted({**result, "partial": True}) from None
        duration = time.perf_counter() - started
        bar.close()
    return _result(config, base, model, results, duration, send_lags)


def _result(
    config: BenchConfig,
    base: str,
    model: str,
    results: Sequence[RequestResult],
    duration: float,
    send_lags: list[float],
) -> dict[str, Any]:
    """The run's metrics and per-request detail, in ``vllm bench serve``'s JSON keys."""
    metrics = compute_metrics(
        results,
        duration,
        percentiles=config.percentiles,
        goodput_slos_ms=config.goodput_slos_ms,
    )
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "base_url": base,
        "endpoint": config.endpoint,
        "model_id": model,
        "num_prompts": len(config.samples),
        "request_rate": config.request_rate if config.request_rate != float("inf") else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
        "send_lags": send_lags,
    }
