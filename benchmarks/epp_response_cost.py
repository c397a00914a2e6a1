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

For each, closed-loop requests of 1, 32 and 512 tokens; EPP CPU seconds (from /proc)
divided by requests. Prints one table; run-to-run noise on this shared 2-core machine is
about +-10 %.

    .venv/bin/python benchmarks/epp_response_cost.py [--tokens 1,32,512] [--concurrency 16]
        [--designs engine,observer,body]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp

from infergate.bench.gateway_rig import MODEL, process_cpu_seconds, start_rig
from infergate.procs import ProcessGroup


async def _closed_loop(url: str, tokens: int, requests: int, concurrency: int) -> int:
    body = {
        "model": MODEL,
        "prompt": "Say something long.",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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
    args = parser.parse_args()
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
            # The EPP's background work (20 Hz metrics scrapes per endpoint) costs CPU per
            # second, not per request: measured idle, it is subtracted for the wall time
            # of each cell, else longer responses look dearer only because they last longer.
            idle_before, idle_t0 = process_cpu_seconds(rig.epp_pid), time.perf_counter()
            time.sleep(args.idle_seconds)
            idle_rate = (process_cpu_seconds(rig.epp_pid) - idle_before) / (
                time.perf_counter() - idle_t0
            )
            for tokens in [t for _ in range(args.repeat) for t in lengths]:
                before, t0 = process_cpu_seconds(rig.epp_pid), time.perf_counter()
                ok = asyncio.run(
                    _closed_loop(rig.gateway_url, tokens, args.requests, args.concurrency)
                )
                used = process_cpu_seconds(rig.epp_pid) - before
                background = idle_rate * (time.perf_counter() - t0)
                net = (used - background) * 1000 / max(ok, 1)
                cells.setdefault(design, {}).setdefault(tokens, []).append(net)
                print(
                    f"{design:>8} {tokens:>4} tokens: {ok} ok, EPP {used * 1000 / max(ok, 1):.2f} "
                    f"ms/req, {net:.2f} net of {idle_rate * 1000:.0f} ms/s background",
                    flush=True,
                )
    print(
        f"\nEPP CPU ms per request, net of background ({args.requests} requests each, "
        f"concurrency {args.concurrency}, mean of {args.repeat})"
    )
    print(f"{'design':>8} " + " ".join(f"{t:>9} tok" for t in lengths) + "   longest/shortest")
    for design, by_length in cells.items():
        row = {t: sum(v) / len(v) for t, v in by_length.items()}
        shown = " ".join(f"{row[t]:>13.2f}" for t in lengths)
        print(f"{design:>8} {shown}   {row[lengths[-1]] / row[lengths[0]]:>8.2f}x")


if __name__ == "__main__":
    main()
