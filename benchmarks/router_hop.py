"""What each router adds to one request's time to first byte, with the engine beside it.

Where a cell's TTFT p90 sits on a cold prompt's own prefill (the routing lab's KV-bound
cells, docs/benchmarks/routing.md), routers that place alike differ by what their hop
costs. This measures that hop alone: one simulated engine (``infergate engine serve
--simulate``), and in front of it Envoy + the EPP (``infergate up``'s gateway), Envoy
alone (the lab's ``round-robin``) and sglang-router (``sglang-cache-aware``, when
installed). Requests go one at a time, so nothing queues: each path is asked in turn for
a fresh prompt (cold: a full prefill) and then the same prompt again (cached), and a
path's figure is its TTFT minus the engine's own (``direct``). Streaming; TTFT is the
first response byte.

    .venv/bin/python benchmarks/router_hop.py [--requests 40] [--prompt-words 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from infergate.bench.routing.routers import ROUTERS, RouterUnavailable
from infergate.stack.local import LocalStack, StackSpec, ensure_tiny_model

WARMUP = 5  # first rounds left out: connections and caches warming up


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice('abcdefgh')}{rng.randrange(10_000)}" for _ in range(words))


def _ttft_ms(client: httpx.Client, url: str, prompt: str) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise SystemExit(f"{url}: HTTP {reply.status_code}: {reply.read()[:200]!r}")
        next(reply.iter_raw())
        return (time.perf_counter() - start) * 1e3


def _paths(stack: LocalStack) -> dict[str, str]:
    paths = {"direct": stack.engine_urls[0], "envoy+epp": stack.base_url}
    for label, name in (("envoy", "round-robin"), ("sglang-router", "sglang-cache-aware")):
        try:
            paths[label] = ROUTERS[name].start(stack)
        except RouterUnavailable as why:
            print(f"{label}: skipped ({why})")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="cold/cached pairs per path")
    parser.add_argument("--prompt-words", type=int, default=300, help="words per prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.requests <= WARMUP or args.prompt_words < 1:
        parser.error(f"--requests must be > {WARMUP} and --prompt-words >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="router-hop-"))
    spec = StackSpec.on_free_ports(
        engines=1,
        model=ensure_tiny_model(workdir / "model"),
        served_model_name="tiny",
        simulate=True,
        workdir=workdir,
        start_timeout=180.0,
    )
    rng = random.Random(args.seed)
    times: dict[tuple[str, str], list[float]] = {}
    with LocalStack(spec) as stack, httpx.Client(timeout=60) as client:
        paths = _paths(stack)
        for _ in range(args.requests):
            for label, url in paths.items():
                prompt = _prompt(rng, args.prompt_words)
                for kind in ("cold", "cached"):
                    times.setdefault((label, kind), []).append(_ttft_ms(client, url, prompt))
                    time.sleep(0.03)  # the engine idle again: nothing queues
    print(f"{'path':14s} {'kind':7s} {'TTFT p50':>9s} {'p90':>7s} {'added p50':>10s}")
    for (label, kind), values in times.items():
        kept = values[WARMUP:]
        p50 = statistics.median(kept)
        p90 = statistics.quantiles(kept, n=10)[-1]
        added = p50 - statistics.median(times[("direct", kind)][WARMUP:])
        print(f"{label:14s} {kind:7s} {p50:9.1f} {p90:7.1f} {added:+10.2f} ms")


if __name__ == "__main__":
    main()
