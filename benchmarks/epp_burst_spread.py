"""Per-engine spread of the default profile's picks within bursts (issue 46, item 2).

Takes a window of a Mooncake-format trace, cuts it into bursts of ``--burst`` consecutive
requests (the conversation trace sends 6-18 with one timestamp; the synthetic one has
none, so they are made here), and routes each burst at one instant through the real
Director with the built-in default profile over ``--engines`` idle engines. Prompts are
built from the block ids (each 512-token id a fixed run of text, so equal ids give equal
prefixes; 4 characters a token, the index's starting guess). Between bursts the clock
moves on ``--gap`` seconds and every engine reports itself idle again (what it had was
computed and is still cached), so each burst starts from the caches the earlier ones
left. Prints, over the window, the max/min of each burst's per-engine counts (round
robin's is 1.00 for a burst that divides evenly) and the per-engine totals.

    .venv/bin/python benchmarks/epp_burst_spread.py --trace ../shared/traces/mooncake-synthetic.jsonl \\
        [--start 0] [--requests 400] [--burst 8] [--engines 4] [--block-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "epp"))
from test_burst_accounting import Fleet  # the tests' real-Director fleet


def prompt(hash_ids: list[int], tokens: int, block_tokens: int) -> str:
    """``tokens`` tokens (at 4 characters) of text, block id ``i`` always the same words."""
    words = [f"b{h:x}w{j % 97} " for h in hash_ids for j in range(block_tokens // 2)]
    return "".join(words)[: tokens * 4]


async def run(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line]
    rows = rows[args.start : args.start + args.requests]
    fleet = Fleet(args.engines)
    scale = args.block_tokens / 512
    spreads, totals = [], Counter[str]()
    for at in range(0, len(rows) - args.burst + 1, args.burst):
        burst = rows[at : at + args.burst]
        prompts = [
            prompt(r["hash_ids"], max(1, int(r["input_length"] * scale)), args.block_tokens)
            for r in burst
        ]
        picked = await fleet.burst(prompts, max_tokens=max(1, int(burst[0]["output_length"])))
        counts = Counter(picked)
        per_engine = [counts.get(s.key, 0) for s in fleet.states]
        spreads.append(max(per_engine) / max(1, min(per_engine)))
        totals.update(picked)
        fleet.now += args.gap
        for state in fleet.states:
            fleet.report(state)
    per_engine = [totals.get(s.key, 0) for s in fleet.states]
    print(
        f"{len(spreads)} bursts of {args.burst} over {args.engines} engines: within-burst "
        f"max/min p50 {statistics.median(spreads):.2f}, mean {statistics.fmean(spreads):.2f}, "
        f"worst {max(spreads):.2f} (round robin 1.00); window per engine {per_engine} "
        f"(max/min {max(per_engine) / max(1, min(per_engine)):.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--start", type=int, default=0, help="first request of the window")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument(
        "--block-tokens", type=int, default=32, help="tokens per 512-token trace block"
    )
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between bursts")
    args = parser.parse_args()
    if args.burst < 1 or args.engines < 1 or args.block_tokens < 2:
        parser.error("--burst, --engines >= 1 and --block-tokens >= 2")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
