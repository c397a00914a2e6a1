"""Where a KV-bound matrix cell's TTFT p90 sits: the cold-prefill plateau, and its bound.

In the routing lab's KV-bound cells (more hot prefixes than the fleet's caches hold),
every router's p90 can fall among the requests that prefill their whole 2,000-token
prefix cold. Then a router moves p90 only by making fewer requests cold, or by serving
the cold ones a little sooner. This script says which, for one cell:

* **the bound**: the cell's requests in order of arrival, each a group (a prefix), on a
  fleet that holds ``S`` prefixes (each engine ``⌊KV tokens ÷ (prefix + question +
  output)⌋``): the misses of Belady's rule (evict the prefix needed furthest ahead; no
  online router does better, whatever it places where) and of one LRU of ``S`` prefixes.
  If even Belady's misses exceed a tenth of the requests, p90 is in the plateau for any
  router;
* **per router** (a lab run's ``requests-*.json``, the same seed): how many requests took
  over ``--slow`` seconds (the cold prefill, or a hit that waited behind one), the
  median of those inside the plateau (``--slow`` to twice it), p90, and the median of the
  per-request differences from ``--reference`` (the same request, same arrival time:
  the lab sends every router the same list).

    .venv/bin/infergate bench routing --matrix standard --cells 8 --seed 589654421 \\
        --router sglang-cache-aware --router epp-infergate --output-dir /tmp/cell8
    .venv/bin/python benchmarks/matrix_cold_plateau.py --cell 8 --seed 589654421 \\
        --results /tmp/cell8
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from infergate.bench.datasets import Tokens
from infergate.bench.routing import matrix
from infergate.bench.routing.lab import tokenizer_dir


def belady_misses(groups: Sequence[int], slots: int) -> int:
    """Misses of the offline optimum: on a miss with no free slot, evict the prefix whose
    next use is furthest ahead (never used again: infinitely far)."""
    upcoming: list[list[int]] = [[] for _ in range(max(groups, default=0) + 1)]
    for at in range(len(groups) - 1, -1, -1):
        upcoming[groups[at]].append(at)  # each group's uses, latest first (pop = next)
    held: set[int] = set()
    misses = 0
    for group in groups:
        upcoming[group].pop()
        if group in held:
            continue
        misses += 1
        if len(held) >= slots:
            held.remove(max(held, key=lambda g: upcoming[g][-1] if upcoming[g] else len(groups)))
        held.add(group)
    return misses


def lru_misses(groups: Sequence[int], slots: int) -> int:
    held: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for group in groups:
        if group in held:
            held.move_to_end(group)
            continue
        misses += 1
        held[group] = None
        if len(held) > slots:
            held.popitem(last=False)
    return misses


def cell_groups(index: int, seed: int, requests: int | None) -> tuple[matrix.Cell, list[int]]:
    """The ``standard`` matrix's cell ``index`` and its requests' groups, as the lab
    builds them for ``seed``."""
    cells = matrix.MATRICES["standard"]
    if not 0 <= index < len(cells):
        raise SystemExit(f"--cell: {index} is outside 0-{len(cells) - 1} (the standard matrix)")
    cell = cells[index]
    if not isinstance(cell, matrix.Cell):
        raise SystemExit(f"--cell {index} is a trace cell: it has no prefix groups")
    n = requests or matrix.workload(cell).num_prompts
    samples = matrix.build_samples(cell, Tokens(tokenizer_dir(None)), n, seed)
    return cell, [s.group for s in samples if s.group is not None]


def router_rows(results: Path, slow: float, reference: str | None) -> list[str]:
    files = sorted(results.glob("requests-*.json"))
    if not files:
        raise SystemExit(f"--results: no requests-*.json in {results} (a routing lab output dir)")
    ttfts = {f.stem: json.loads(f.read_text())["ttft_s"] for f in files}
    ref = next((k for k in ttfts if reference and k.endswith(reference)), None)
    if reference and ref is None:
        raise SystemExit(f"--reference: no requests-*{reference}.json in {results}")
    rows = []
    for name, times in ttfts.items():
        done = sorted(t for t in times if t is not None)
        over = [t for t in done if t > slow]
        plateau = [t for t in over if t <= 2.0 * slow]
        p90 = done[int(0.9 * len(done))] if done else float("nan")
        line = (
            f"{name}: {len(over)} of {len(times)} over {slow * 1e3:.0f} ms, plateau median "
            f"{statistics.median(plateau) * 1e3 if plateau else float('nan'):.1f} ms "
            f"({len(plateau)}), p90 {p90 * 1e3:.1f} ms"
        )
        if ref is not None and name != ref:
            pairs = [
                a - b
                for a, b in zip(times, ttfts[ref], strict=False)
                if a is not None and b is not None
            ]
            line += f", per request vs {reference}: median {statistics.median(pairs) * 1e3:+.2f} ms"
        rows.append(line)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", type=int, required=True, help="index in --matrix standard")
    parser.add_argument("--seed", type=int, required=True, help="the lab run's seed")
    parser.add_argument("--requests", type=int, help="requests in the run (default: the cell's)")
    parser.add_argument("--results", type=Path, help="a lab run's --output-dir for this cell")
    parser.add_argument("--slow", type=float, default=0.1, help="seconds: a slow request")
    parser.add_argument("--reference", default="sglang-cache-aware", help="router to pair with")
    args = parser.parse_args()
    cell, groups = cell_groups(args.cell, args.seed, args.requests)
    held = matrix.KV_BLOCKS * matrix.BLOCK_SIZE
    per_request = matrix.PREFIX_TOKENS + matrix.QUESTION_TOKENS + matrix.OUTPUT_TOKENS
    slots = cell.engines * (held // per_request)
    print(
        f"{cell.name}: {len(groups)} requests over {len(set(groups))} of {cell.groups} groups; "
        f"the fleet holds {slots} prefixes"
    )
    for s in (slots - 2, slots, slots + 2):
        print(
            f"  {s} prefixes: Belady {belady_misses(groups, s)} misses, LRU {lru_misses(groups, s)}"
        )
    print(f"  a tenth of the requests: {len(groups) // 10}")
    if args.results is not None:
        for line in router_rows(args.results, args.slow, args.reference):
            print(line)


if __name__ == "__main__":
    main()
