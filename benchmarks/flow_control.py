"""Flow control off vs on: per-priority TTFT and per-tenant throughput on an overloaded fleet.

A fresh simulated fleet (2 engines, ``--max-num-seqs 4``) behind the real Envoy and EPP,
once with the EPP's default admission (shed-or-pass: sheddable requests get 429 while the
pool is saturated, everything else goes straight to an engine's FCFS queue) and once with
``flowControl`` on (requests wait in the EPP by priority band and tenant; 4 dispatched per
engine). The same seeded open-loop (Poisson) workload drives both, about 1.3x what the
fleet serves:

- ``critical`` (InferenceObjective priority 100), 1 req/s;
- ``standard`` (no objective, priority 0) from two tenants at 10:1 —
  ``heavy`` 20 req/s and ``light`` 2 req/s (``x-gateway-inference-fairness-id``);
- ``batch`` (priority -1, sheddable), 4 req/s.

Every request streams 64 tokens (simulated engines never stop early). TTFT is the time to
the first streamed token, as the client sees it; throughput counts the requests that
completed with 200 per second of the run. A second part measures memory under a burst of
10,000 queued requests in one flow controller (``--memory-only`` runs just that).

    .venv/bin/python benchmarks/flow_control.py [--seconds 20] [--seed 1] [--memory-only]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infergate.stack.local import LocalStack, StackSpec, ensure_tiny_model

OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 100, poolRef: {name: local}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: local}}
"""
PROFILE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""
FLOW_CONTROL = """\
flowControl:
  maxRequestsPerEndpoint: 4
  useSaturationDetector: true
  defaultRequestTTL: 20s
  fairnessPolicy: round-robin
"""
#: (class, objective header, tenant, rate req/s)
STREAMS = [
    ("critical", "critical", "default", 1.0),
    ("standard/heavy", "", "heavy", 20.0),
    ("standard/light", "", "light", 2.0),
    ("batch", "batch", "default", 4.0),
]
MAX_TOKENS = 64


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    ok: int = 0
    rejected: int = 0
    failed: int = 0


async def _one(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], prompt: str, stats: Stats
) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code == 429:
                stats.rejected += 1
                return
            if response.status_code != 200:
                stats.failed += 1
                return
            async for line in response.aiter_lines():
                if first is None and line.startswith("data:") and "[DONE]" not in line:
                    first = time.perf_counter() - started
        if first is not None:
            stats.ttft.append(first)
        stats.ok += 1
    except httpx.HTTPError:
        stats.failed += 1


async def _drive(base_url: str, seconds: float, seed: int) -> dict[str, Stats]:
    rng = random.Random(seed)
    arrivals: list[tuple[float, str, str, str]] = []
    for name, objective, tenant, rate in STREAMS:
        t = rng.expovariate(rate)
        while t < seconds:
            arrivals.append((t, name, objective, tenant))
            t += rng.expovariate(rate)
    arrivals.sort()
    stats = {name: Stats() for name, *_ in STREAMS}
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    url = f"{base_url}/v1/completions"
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i, (at, name, objective, tenant) in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            headers = {"x-gateway-inference-fairness-id": tenant}
            if objective:
                headers["x-gateway-inference-objective"] = objective
            prompt = f"{name} request {i}: " + " ".join(str(rng.random())[:6] for _ in range(40))
            tasks.append(asyncio.create_task(_one(client, url, headers, prompt, stats[name])))
        await asyncio.gather(*tasks)
        stats["_elapsed"] = Stats(ttft=[time.perf_counter() - start])
    return stats


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_fleet(flow_control: bool, seconds: float, seed: int, model: Path) -> dict[str, Stats]:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "objectives.yaml").write_text(OBJECTIVES)
        (workdir / "epp.yaml").write_text(PROFILE + (FLOW_CONTROL if flow_control else ""))
        spec = StackSpec.on_free_ports(
            engines=2,
            model=model,
            served_model_name="tiny",
            simulate=True,
            objectives_file=workdir / "objectives.yaml",
            epp_config_file=workdir / "epp.yaml",
            engine_args=["--max-num-seqs", "4"],
            access_log=False,
            workdir=workdir,
            start_timeout=180.0,
        )
        with LocalStack(spec) as stack:
            return asyncio.run(_drive(stack.base_url, seconds, seed))


def print_table(label: str, stats: dict[str, Stats], seconds: float) -> dict[str, dict]:
    elapsed = stats.pop("_elapsed").ttft[0]
    print(f"\n{label} (run {seconds:.0f}s of arrivals, {elapsed:.1f}s until the last answer)")
    print(
        f"{'class':<16} {'ok':>5} {'429':>5} {'fail':>5} {'TTFT p50 ms':>12} "
        f"{'TTFT p99 ms':>12} {'ok req/s':>9}"
    )
    out = {}
    for name, s in stats.items():
        p50, p99 = _pct(s.ttft, 0.5) * 1000, _pct(s.ttft, 0.99) * 1000
        rate = s.ok / elapsed
        print(
            f"{name:<16} {s.ok:>5} {s.rejected:>5} {s.failed:>5} {p50:>12.0f} {p99:>12.0f} "
            f"{rate:>9.2f}"
        )
        out[name] = {"ok": s.ok, "rejected_429": s.rejected, "failed": s.failed,
                     "ttft_p50_ms": p50, "ttft_p99_ms": p99, "ok_per_s": rate}  # fmt: skip
    return out


async def _memory_burst(n: int) -> dict[str, float]:
    """Bytes held per queued request: the flow controller's structures alone, then with
    the waiting asyncio task that each request is in the EPP anyway (its ext-proc handler)."""
    from infergate.epp.datalayer.datastore import Datastore
    from infergate.epp.flowcontrol.config import FlowControlConfig
    from infergate.epp.flowcontrol.controller import FlowController
    from infergate.epp.flowcontrol.metrics import FlowControlMetrics
    from infergate.epp.flowcontrol.saturation import SaturationDetector
    from infergate.epp.types import Endpoint
    from prometheus_client import CollectorRegistry, generate_latest

    datastore = Datastore()
    datastore.set_endpoints([Endpoint("127.0.0.1", 8000), Endpoint("127.0.0.1", 8001)])
    config = FlowControlConfig.model_validate(
        {"maxRequestsPerEndpoint": 1, "useSaturationDetector": False, "maxRequests": n}
    )
    registry = CollectorRegistry()
    flow = FlowController(
        config, datastore, SaturationDetector(5, 0.8, 2.0), FlowControlMetrics(registry)
    )
    held = [await flow.admit(0, "default", 1), await flow.admit(0, "default", 1)]
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    tasks = [
        asyncio.create_task(flow.admit(i % 3 - 1, f"tenant-{i % 100}", 1024)) for i in range(n)
    ]
    for _ in range(3):
        await asyncio.sleep(0)
    queued = len(flow.queues)
    with_tasks, _ = tracemalloc.get_traced_memory()
    snapshot = tracemalloc.take_snapshot()
    queue_bytes = sum(
        stat.size
        for stat in snapshot.statistics("filename")
        if "flowcontrol" in stat.traceback[0].filename
    )
    rejected = 0
    try:
        await flow.admit(0, "over", 1)
    except Exception:
        rejected = 1
    started = time.perf_counter()
    scrape = generate_latest(registry)
    scrape_ms = (time.perf_counter() - started) * 1000
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    del tasks  # the client side's handles; what the EPP keeps is what is left after this
    for ticket in held:
        flow.release(ticket)
    await asyncio.sleep(0)  # one loop turn: asyncio drops the cancelled TTL timers
    gc.collect()
    after, _ = tracemalloc.get_traced_memory()
    if os.environ.get("FLOW_BENCH_DEBUG"):
        for stat in tracemalloc.take_snapshot().statistics("lineno")[:8]:
            print("  left:", stat)
    tracemalloc.stop()
    await flow.close()
    return {
        "queued": queued,
        "over_bound_rejected": rejected,
        "bytes_per_request_with_task": (with_tasks - base) / n,
        "bytes_per_request_flowcontrol_only": queue_bytes / n,
        "scrape_ms_at_10k": scrape_ms,
        "scrape_bytes_at_10k": len(scrape),
        "left_after_cancel_bytes": after - base,
        "left_queued": len(flow.queues),
        "left_bands": len(flow.queues.bands),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--result-file", type=Path)
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}"
    )
    results: dict[str, object] = {}
    if not args.memory_only:
        model = ensure_tiny_model()
        for label, on in (("flow control off", False), ("flow control on", True)):
            stats = run_fleet(on, args.seconds, args.seed, model)
            results[label] = print_table(label, stats, args.seconds)
    memory = asyncio.run(_memory_burst(args.burst))
    results["memory"] = memory
    print(f"\nburst of {args.burst} queued requests in one flow controller:")
    for key, value in memory.items():
        print(f"  {key}: {value:.1f}" if isinstance(value, float) else f"  {key}: {value}")
    if args.result_file:
        args.result_file.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
