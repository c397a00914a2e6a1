"""EPP decision latency: parse body → rewrite/objective → admission → schedule → pre-request.

Runs the real Director with the default profile (saturation-filter, queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score-picker) over 8, 64 and
256 endpoints with fresh random metrics, on chat requests of ~2 KB whose prompts share
long prefixes in groups (so the prefix index is populated and matched, as in production).
Prints p50/p99 per pool size. Target: <= 1 ms per decision at 64 endpoints.

    .venv/bin/python benchmarks/epp_decision.py [--requests 3000] [--sizes 8,64,256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from infergate.epp.config import load_config
from infergate.epp.datastore import Datastore
from infergate.epp.director import Director
from infergate.epp.objectives import ObjectiveStore
from infergate.epp.observability import EppMetrics
from infergate.epp.plugins import PluginContext
from infergate.epp.saturation import SaturationDetector
from infergate.epp.scheduler import Scheduler
from infergate.epp.types import Endpoint, InferenceRequest, Metrics


def build(n: int) -> Director:
    datastore = Datastore()
    datastore.set_endpoints(Endpoint(f"10.0.{i // 250}.{i % 250 + 1}", 8000) for i in range(n))
    now = time.monotonic()
    for state in datastore.all():
        state.metrics = Metrics(
            waiting=random.randint(0, 6),
            running=random.randint(0, 32),
            kv_usage=random.random() * 0.9,
            updated_at=now + 3600,  # stays fresh for the whole run
        )
    saturation = SaturationDetector(5, 0.8, 2.0)
    metrics = EppMetrics(datastore, saturation)
    context = PluginContext(datastore, saturation, {"metrics": metrics})
    scheduler = Scheduler.from_config(load_config(None), context, metrics.plugin_timer)
    return Director(datastore, scheduler, saturation, ObjectiveStore(), metrics)


def bodies(count: int, groups: int = 32) -> list[bytes]:
    systems = [
        f"You are assistant {g}. " + "Follow the policy carefully. " * 50 for g in range(groups)
    ]
    out = []
    for i in range(count):
        messages = [
            {"role": "system", "content": systems[random.randrange(groups)]},
            {"role": "user", "content": f"Question {i}: " + "tell me something new " * 10},
        ]
        out.append(json.dumps({"model": "m", "messages": messages, "max_tokens": 64}).encode())
    return out


async def measure(n: int, requests: int) -> tuple[float, float, float, float, float]:
    director = build(n)
    payloads = bodies(requests)
    for payload in payloads[:200]:  # warm the prefix index and code paths
        await director.route(InferenceRequest("w", {}), payload, None)
    samples, cpu = [], []
    for i, payload in enumerate(payloads):
        started, cpu_started = time.perf_counter(), time.thread_time()
        decision = await director.route(InferenceRequest(str(i), {}), payload, None)
        samples.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - cpu_started)
        decision.result.targets[0].in_flight_requests -= 1
    samples.sort()
    cpu.sort()

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(len(values) * q))] * 1e3

    return (
        pct(samples, 0.5),
        pct(samples, 0.99),
        statistics.fmean(samples) * 1e3,
        pct(cpu, 0.5),
        pct(cpu, 0.99),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--sizes", default="8,64,256")
    args = parser.parse_args()
    random.seed(0)
    print("wall = elapsed time per decision; cpu = this thread's CPU time (immune to other")
    print("processes preempting us on a shared machine, which is what inflates wall p99)")
    header = ["endpoints", "wall p50", "wall p99", "wall mean", "cpu p50", "cpu p99"]
    print(" ".join(f"{h:>10}" for h in header) + "   (ms)")
    for n in (int(s) for s in args.sizes.split(",")):
        row = asyncio.run(measure(n, args.requests))
        print(f"{n:>10} " + " ".join(f"{v:>10.3f}" for v in row))


if __name__ == "__main__":
    main()
