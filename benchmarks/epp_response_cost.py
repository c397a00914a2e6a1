"""EPP CPU per request against the length of the streamed response, per response design.

Real Envoy, real ``infergate epp``, simulated engines streaming N-token SSE answers
(one chunk per token). Two Envoy configurations of the same generated bootstrap:

* ``single``: GIE's one ext_proc filter, response bodies FULL_DUPLEX_STREAMED through the
  EPP (a gRPC message pair per chunk);
* ``observe`` (the default now): the routing filter sees no response body; a second
  ext_proc filter in observability mode streams the response to the EPP without
  waiting for answers (usage read there).

For each, closed-loop requests of 1, 32 and 512 tokens; EPP CPU seconds (from /proc)
divided by requests. Prints one table; run-to-run noise on this shared 2-core machine is
about +-10 %.

    .venv/bin/python benchmarks/epp_response_cost.py [--tokens 1,32,512] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
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
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    table: dict[str, dict[int, float]] = {}
    for design in ("single", "observe"):
        with ProcessGroup() as group, tempfile.TemporaryDirectory() as tmp:
            rig = start_rig(
                group,
                Path(tmp),
                upstream="engine",
                endpoints=2,
                observe_responses=design == "observe",
            )
            asyncio.run(_closed_loop(rig.gateway_url, 1, 16, 4))  # warm up
            for tokens in lengths:
                before = process_cpu_seconds(rig.epp_pid)
                ok = asyncio.run(
                    _closed_loop(rig.gateway_url, tokens, args.requests, args.concurrency)
                )
                used = process_cpu_seconds(rig.epp_pid) - before
                table.setdefault(design, {})[tokens] = used * 1000 / max(ok, 1)
                print(
                    f"{design:>8} {tokens:>4} tokens: {ok} ok, EPP {table[design][tokens]:.2f} ms/req",
                    flush=True,
                )
    print(
        f"\nEPP CPU ms per request ({args.requests} requests each, concurrency {args.concurrency})"
    )
    print(f"{'design':>8} " + " ".join(f"{t:>9} tok" for t in lengths) + "   longest/shortest")
    for design, row in table.items():
        cells = " ".join(f"{row[t]:>13.2f}" for t in lengths)
        print(f"{design:>8} {cells}   {row[lengths[-1]] / row[lengths[0]]:>8.2f}x")


if __name__ == "__main__":
    main()
