"""EPP decision latency: parse body → rewrite/objective → admission → schedule → pre-request.

Runs the real Director with the default profile (saturation-filter, queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score-picker) over 8, 64 and
256 endpoints with fresh random metrics, on chat requests of ~2 KB whose prompts share
long prefixes in groups (so the prefix index is populated and matched, as in production).
Prints p50/p99 per pool size. Target: <= 1 ms per decision at 64 endpoints.

With ``--extproc`` it instead drives a real ``infergate epp`` process over gRPC the way
Envoy does (request headers, body, response headers, response body per stream; no
Envoy, no engine) and prints streams/s, stream latency and the EPP process's CPU per
stream, sequentially and at 16 concurrent streams.

    .venv/bin/python benchmarks/epp_decision.py [--requests 3000] [--sizes 8,64,256]
    .venv/bin/python benchmarks/epp_decision.py --extproc [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import sys
import time
from typing import Any

from infergate.epp.config import load_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.objectives import ObjectiveStore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.observability import EppMetrics
from infergate.epp.requestcontrol.director import Director
from infergate.epp.scheduling.plugins import PluginContext
from infergate.epp.scheduling.scheduler import Scheduler
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
    scheduler = Scheduler.from_config(load_config(CONFIG), context, metrics.plugin_timer)
    return Director(datastore, scheduler, saturation, ObjectiveStore(), metrics)


#: EndpointPickerConfig file to run (``--config``); None: the built-in default profile.
CONFIG: str | None = None


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


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@functools.cache
def _stream_messages() -> tuple[Any, list[Any], Any, Any]:
    """One ext-proc stream's messages: request headers, request bodies (one per stream,
    cycled), response headers, and a response body carrying usage."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    def hdrs(items: dict[str, str]) -> Any:
        values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]
        return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values))

    request_headers = pb.ProcessingRequest(
        request_headers=hdrs({":method": "POST", ":path": "/v1/chat/completions"})
    )
    response_headers = pb.ProcessingRequest(response_headers=hdrs({":status": "200"}))
    usage = b'{"usage":{"prompt_tokens":300,"completion_tokens":64}}'
    response_body = pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True))
    payloads = [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b, end_of_stream=True))
        for b in bodies(256)
    ]
    return request_headers, payloads, response_headers, response_body


async def run_stream(stub: Any, i: int) -> None:
    """One whole ext-proc stream as Envoy drives it: headers and body (body i of the
    cycle) for the pick, then the response headers and the usage-bearing body."""
    request_headers, payloads, response_headers, response_body = _stream_messages()
    call = stub.Process()
    await call.write(request_headers)
    await call.write(payloads[i % len(payloads)])
    await call.read()
    await call.read()
    await call.write(response_headers)
    await call.read()
    await call.write(response_body)
    await call.read()
    await call.done_writing()


async def extproc(requests: int, endpoints: int) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from infergate.procs import ProcessGroup, free_port, tcp_ready

    port = free_port()
    from infergate.epp.options import EPP_PORTS, EppOptions
    from infergate.epp.types import Endpoint

    options = EppOptions(
        static_endpoints=[Endpoint("127.0.0.1", 20000 + i) for i in range(endpoints)],
        host="127.0.0.1", grpc_port=port, grpc_health_port=free_port(),
        metrics_port=free_port(), refresh_metrics_interval=3600, log_level="error",
    )  # fmt: skip
    argv = [sys.executable, "-m", "infergate.cli", *options.argv(always=EPP_PORTS)]
    with ProcessGroup() as group:
        epp = group.start("epp", argv, ready=tcp_ready("127.0.0.1", port), timeout=60)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)

            async def one(i: int) -> None:
                await run_stream(stub, i)

            for i in range(200):
                await one(i)
            print(
                f"ext-proc streams against a real `infergate epp` ({endpoints} endpoints), client in this process"
            )
            for concurrency in (1, 16):
                limit = asyncio.Semaphore(concurrency)
                latencies: list[float] = []

                async def timed(
                    i: int, limit: asyncio.Semaphore = limit, latencies: list[float] = latencies
                ) -> None:
                    async with limit:
                        started = time.perf_counter()
                        await one(i)
                        latencies.append(time.perf_counter() - started)

                cpu0, wall0 = _cpu_seconds(epp.pid), time.perf_counter()
                await asyncio.gather(*(timed(i) for i in range(requests)))
                wall, cpu = time.perf_counter() - wall0, _cpu_seconds(epp.pid) - cpu0
                latencies.sort()
                print(
                    f"  concurrency {concurrency:>2}: {requests / wall:6.0f} streams/s, "
                    f"p50 {latencies[len(latencies) // 2] * 1e3:.2f} ms, "
                    f"p99 {latencies[int(len(latencies) * 0.99)] * 1e3:.2f} ms, "
                    f"EPP CPU {cpu / requests * 1e3:.3f} ms per stream"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--sizes", default="8,64,256")
    parser.add_argument("--extproc", action="store_true", help="drive a real EPP over gRPC")
    parser.add_argument("--endpoints", type=int, default=8, help="pool size for --extproc")
    parser.add_argument(
        "--config", help="EndpointPickerConfig file (default: the built-in default)"
    )
    args = parser.parse_args()
    global CONFIG
    CONFIG = args.config
    random.seed(0)
    if args.extproc:
        asyncio.run(extproc(args.requests, args.endpoints))
        return
    print("wall = elapsed time per decision; cpu = this thread's CPU time (immune to other")
    print("processes preempting us on a shared machine, which is what inflates wall p99)")
    header = ["endpoints", "wall p50", "wall p99", "wall mean", "cpu p50", "cpu p99"]
    print(" ".join(f"{h:>10}" for h in header) + "   (ms)")
    for n in (int(s) for s in args.sizes.split(",")):
        row = asyncio.run(measure(n, args.requests))
        print(f"{n:>10} " + " ".join(f"{v:>10.3f}" for v in row))


if __name__ == "__main__":
    main()
