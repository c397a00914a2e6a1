"""EPP CPU per request against the length of the streamed response, per response design.

Real Envoy, real ``infergate epp``, simulated engines streaming N-token SSE answers
(one chunk per token). Three ``response_accounting`` settings of the same generated
bootstrap (``build_envoy_config``):

* ``body``: GIE's one ext_proc filter, response bodies FULL_DUPLEX_STREAMED through the
  EPP (a gRPC message pair per chunk);
* ``observer``: the routing filter sees no response body; a second ext_proc filter in
  observability mode streams the response to the EPP without waiting for answers (usage
  read there) — for engines that cannot report;
* ``engine`` (the default): no response body reaches the EPP; the engines publish one
  completion record per request (ZMQ) with usage and cached tokens.

For each, requests of 1, 32 and 512 tokens; EPP CPU seconds (from /proc) divided by
requests. Prints one table; run-to-run noise on this shared 2-core machine is about +-10 %.

Two ways to load it:

* closed loop (default): ``--concurrency`` clients back to back. Longer answers then mean
  fewer requests per second, and the EPP's fixed per-wake-up costs (gRPC's poller thread
  handing each completion to the event loop) are shared by fewer requests, so a closed
  loop shows long answers dearer even where nothing runs per chunk. The EPP's background
  work (scrapes, health checks) is measured idle and subtracted for each cell's wall time.
* ``--rate R``: Poisson arrivals at R requests/s for every length, so only the length
  differs. Each cell runs twice, through the gateway and through its Envoy-direct twin
  (same engines, same load, no EPP on the path), and the EPP CPU of the twin run (its
  background work under the same engine load) is subtracted:
  ``net = (cpu_gateway - cpu_direct × t_gateway / t_direct) / requests``.
  /proc counts CPU in 10 ms ticks: give each cell a few hundred requests.

    .venv/bin/python benchmarks/epp_response_cost.py [--tokens 1,32,512] [--concurrency 16]
        [--designs engine,observer,body] [--rate 20 --seconds 20] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
from gateway_rig import MODEL, Rig, process_cpu_seconds, start_rig

from infergate.bench.metrics import arrival_times
from infergate.procs import ProcessGroup


def _body(tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": "Say something long.",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _closed_loop(url: str, tokens: int, requests: int, concurrency: int) -> int:
    body = _body(tokens)
    ok = 0
    queue = list(range(requests))

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal ok
        while queue:
            queue.pop()
            async with session.post(url, json=body) as response:
                await response.read()
                ok += response.status == 200

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return ok


async def _open_loop(url: str, tokens: int, rate: float, seconds: float, seed: int) -> int:
    """Poisson arrivals at ``rate`` for ``seconds``, each a streamed ``tokens``-token answer
    read to its end; returns how many got a 200."""
    body = _body(tokens)
    ok = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal ok
        async with session.post(url, json=body) as response:
            await response.read()
            ok += response.status == 200

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started, tasks = time.perf_counter(), []
        for offset in arrival_times(max(1, int(rate * seconds)), rate, seed=seed):
            delay = started + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    return ok


def _cpu_of(
    rig: Rig, url: str, tokens: int, rate: float, seconds: float, seed: int
) -> tuple[float, float, int]:
    """EPP CPU seconds, wall seconds and successes of one open-loop run against ``url``."""
    before, t0 = process_cpu_seconds(rig.epp_pid), time.perf_counter()
    ok = asyncio.run(_open_loop(url, tokens, rate, seconds, seed))
    return process_cpu_seconds(rig.epp_pid) - before, time.perf_counter() - t0, ok


def _equal_rate_cell(
    rig: Rig, tokens: int, rate: float, seconds: float, seed: int
) -> tuple[float, str]:
    """Net EPP CPU ms per request at ``rate``, against the direct twin under the same load."""
    gateway_cpu, gateway_wall, ok = _cpu_of(rig, rig.gateway_url, tokens, rate, seconds, seed)
    direct_cpu, direct_wall, _ = _cpu_of(rig, rig.direct_url, tokens, rate, seconds, seed)
    net = (gateway_cpu - direct_cpu * gateway_wall / direct_wall) * 1000 / max(ok, 1)
    text = (
        f"{ok} ok at {rate:g}/s, EPP {gateway_cpu * 1000:.0f} ms in {gateway_wall:.1f} s, "
        f"direct twin {direct_cpu * 1000:.0f} ms in {direct_wall:.1f} s -> {net:.2f} ms/req"
    )
    return net, text


def _idle_rate(rig: Rig, seconds: float) -> float:
    """EPP CPU seconds per second with no traffic.

    The EPP's background work (metrics scrapes per endpoint) costs CPU per second, not per
    request: the closed loop subtracts it for the wall time of each cell, else longer
    responses look dearer only because they last longer."""
    before, t0 = process_cpu_seconds(rig.epp_pid), time.perf_counter()
    time.sleep(seconds)
    return (process_cpu_seconds(rig.epp_pid) - before) / (time.perf_counter() - t0)


def _closed_loop_cell(
    rig: Rig, tokens: int, requests: int, concurrency: int, idle_rate: float
) -> tuple[float, str]:
    """Net EPP CPU ms per request of ``requests`` closed-loop requests, idle rate subtracted."""
    before, t0 = process_cpu_seconds(rig.epp_pid), time.perf_counter()
    ok = asyncio.run(_closed_loop(rig.gateway_url, tokens, requests, concurrency))
    used = process_cpu_seconds(rig.epp_pid) - before
    net = (used - idle_rate * (time.perf_counter() - t0)) * 1000 / max(ok, 1)
    text = (
        f"{ok} ok, EPP {used * 1000 / max(ok, 1):.2f} ms/req, {net:.2f} net of "
        f"{idle_rate * 1000:.0f} ms/s background"
    )
    return net, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,32,512")
    parser.add_argument("--requests", type=int, default=64, help="per token count")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--designs", default="engine,observer,body")
    parser.add_argument("--idle-seconds", type=float, default=4.0)
    parser.add_argument("--refresh", default="1s", help="the EPP's --refresh-metrics-interval")
    parser.add_argument(
        "--repeat", type=int, default=1, help="cycle through the lengths this often; mean shown"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="open loop at this many requests/s for every length, net of the direct twin "
        "(0: closed loop at --concurrency, net of idle background)",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="per cell, with --rate")
    args = parser.parse_args()
    if args.rate < 0 or args.seconds <= 0:
        parser.error("--rate must be >= 0 and --seconds > 0")
    lengths = [int(t) for t in args.tokens.split(",")]
    cells: dict[str, dict[int, list[float]]] = {}  # net of background work, per repeat
    for design in args.designs.split(","):
        with ProcessGroup() as group, tempfile.TemporaryDirectory() as tmp:
            rig = start_rig(
                group,
                Path(tmp),
                upstream="engine",
                endpoints=2,
                response_accounting=design,
                # Scrapes every second, not 20 Hz: their CPU is per second of wall time,
                # and longer answers last longer (what remains is subtracted below).
                epp_args=["--refresh-metrics-interval", args.refresh],
            )
            asyncio.run(_closed_loop(rig.gateway_url, 1, 16, 4))  # warm up
            idle_rate = 0.0 if args.rate else _idle_rate(rig, args.idle_seconds)
            for i, tokens in enumerate(t for _ in range(args.repeat) for t in lengths):
                if args.rate:
                    net, text = _equal_rate_cell(rig, tokens, args.rate, args.seconds, seed=i)
                else:
                    net, text = _closed_loop_cell(
                        rig, tokens, args.requests, args.concurrency, idle_rate
                    )
                cells.setdefault(design, {}).setdefault(tokens, []).append(net)
                print(f"{design:>8} {tokens:>4} tokens: {text}", flush=True)
    load = (
        f"open loop at {args.rate:g} req/s for {args.seconds:g} s, net of the direct twin"
        if args.rate
        else f"{args.requests} requests each, concurrency {args.concurrency}, net of idle background"
    )
    print(f"\nEPP CPU ms per request ({load}, mean of {args.repeat})")
    print(f"{'design':>8} " + " ".join(f"{t:>9} tok" for t in lengths) + "   longest/shortest")
    for design, by_length in cells.items():
        row = {t: sum(v) / len(v) for t, v in by_length.items()}
        shown = " ".join(f"{row[t]:>13.2f}" for t in lengths)
        print(f"{design:>8} {shown}   {row[lengths[-1]] / row[lengths[0]]:>8.2f}x")


if __name__ == "__main__":
    main()
