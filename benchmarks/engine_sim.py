"""Simulated-mode engine: its own CPU overhead per step, and prefix caching's TTFT effect.

Prints (never asserts):

1. overhead: ``EngineCore.step`` with the simulated runner's sleep switched off, i.e. the
   scheduler, KV manager, filler sampling and detokenization alone — µs per step and
   steps/s at several batch sizes;
2. TTFT through a real ``infergate engine serve --simulate`` process: prompts of ~1k
   tokens, all distinct vs sharing a 1k-token prefix (streamed, first-token time);
3. ``--fleet N`` simulated engines at once on this machine, each with concurrent
   streams: client-side inter-token latency, and by how much the engines' steps overran
   their modelled time (their ``infergate_sim_*`` counters).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams
from infergate.engine.serve import filler_token_ids
from infergate.engine.sim_runner import SimulatedRunner, TimingModel
from infergate.engine.tokenizer import Tokenizer

from infergate.procs import ProcessGroup, free_port, http_ready


def overhead(model_dir: Path, batch: int, prompt_len: int, max_tokens: int) -> tuple[float, float]:
    tok = Tokenizer(model_dir)
    runner = SimulatedRunner(
        block_size=16, num_blocks=20000, filler_token_ids=filler_token_ids(tok), sleep=False
    )
    core = EngineCore(runner, SchedulerConfig(max_num_seqs=max(batch, 1)), tokenizer=tok)
    for i in range(batch):
        prompt = [(i * 7 + j) % 300 + 5 for j in range(prompt_len)]
        core.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens)))
    steps = 0
    start = time.perf_counter()
    while core.has_work():
        core.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return elapsed / steps * 1e6, steps / elapsed


async def first_token_time(client: httpx.AsyncClient, prompt: str) -> float:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 4, "stream": True}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as res:
        res.raise_for_status()
        async for line in res.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def start_engine(group: ProcessGroup, model_dir: Path, name: str, *extra: str) -> str:
    port = free_port()
    group.start(
        name,
        ["infergate", "engine", "serve", str(model_dir), "--simulate", "--port", str(port),
         "--served-model-name", "sim", "--log-level", "warning", *extra],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    return f"http://127.0.0.1:{port}"


def shared_prefix(tok: Tokenizer) -> str:
    """A text of exactly 1024 tokens (a long system prompt)."""
    words = ["the", "system", "the", "model", "the", "user", "and", "assistant", "took", "turns"]
    text = " ".join(words[i % len(words)] for i in range(1500))
    return tok.decode(tok.encode(text, add_special_tokens=False)[:1024])


async def ttft(url: str, tok: Tokenizer, n: int) -> tuple[list[float], list[float]]:
    shared = shared_prefix(tok)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        distinct = []
        for i in range(n):
            # Same length, but a different first block: the whole hash chain differs.
            distinct.append(await first_token_time(client, f"{i} {shared} question {i}?"))
        await first_token_time(client, shared + " warm")  # put the prefix in the cache
        cached = [await first_token_time(client, f"{shared} question {i}?") for i in range(n)]
    return distinct, cached


async def fleet(urls: list[str], streams: int, max_tokens: int) -> list[float]:
    """Per-token gaps observed by clients of every engine at once."""
    gaps: list[float] = []

    async def one(client: httpx.AsyncClient, k: int) -> None:
        body = {"model": "sim", "prompt": f"stream {k} " * 50, "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}  # fmt: skip
        last = None
        async with client.stream("POST", "/v1/completions", json=body) as res:
            async for line in res.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    clients = [httpx.AsyncClient(base_url=u, timeout=120) for u in urls]
    try:
        await asyncio.gather(*(one(c, k) for c in clients for k in range(streams)))
    finally:
        for c in clients:
            await c.aclose()
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model dir (default: a fresh tiny model)")
    ap.add_argument("--requests", type=int, default=8, help="TTFT samples per case")
    ap.add_argument("--fleet", type=int, default=8, help="engines for the fleet test (0: skip)")
    ap.add_argument("--fleet-streams", type=int, default=8, help="concurrent streams per engine")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from infergate.engine.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0)
        tok = Tokenizer(model_dir)

        print("== simulator overhead (EngineCore.step, sleep off)")
        print(f"{'batch':>6} {'µs/step':>9} {'steps/s':>9}")
        for batch in (1, 32, 256):
            us, rate = overhead(model_dir, batch, prompt_len=128, max_tokens=256)
            print(f"{batch:>6} {us:>9.0f} {rate:>9.0f}")

        with ProcessGroup() as group:
            url = start_engine(group, model_dir, "engine-sim")
            distinct, cached = asyncio.run(ttft(url, tok, args.requests))
        model = TimingModel()
        print("\n== TTFT through `infergate engine serve --simulate` (1 request at a time)")
        n_tokens = len(tok.encode(f"0 {shared_prefix(tok)} question 0?"))
        print(f"prompts of {n_tokens} tokens, {args.requests} each; medians:")
        print(f"distinct prompts           : median {statistics.median(distinct) * 1e3:6.1f} ms")
        print(f"sharing a 1024-token prefix: median {statistics.median(cached) * 1e3:6.1f} ms")
        print(f"(timing model: 1024 uncached tokens = {model.base_ms:.0f}..."
              f"{1024 * model.us_per_token / 1e3:.1f} ms of compute)")  # fmt: skip

        if args.fleet:
            with ProcessGroup() as group:
                urls = [start_engine(group, model_dir, f"sim-{i}") for i in range(args.fleet)]
                gaps = asyncio.run(fleet(urls, args.fleet_streams, 200))
                modelled, late, steps = sim_counters(urls)
            print(f"\n== {args.fleet} simulated engines x {args.fleet_streams} streams at once")
            print(f"client-side ITL: mean {statistics.mean(gaps) * 1e3:.2f} ms, "
                  f"p50 {statistics.median(gaps) * 1e3:.2f} ms, "
                  f"p99 {statistics.quantiles(gaps, n=100)[98] * 1e3:.2f} ms")  # fmt: skip
            print(f"engine steps: {steps}, modelled {modelled:.2f} s, overran by {late:.3f} s "
                  f"({late / modelled:.1%} of modelled time)")  # fmt: skip


def sim_counters(urls: list[str]) -> tuple[float, float, int]:
    """Sum of modelled step time, lateness and steps over the engines' /metrics."""
    modelled = late = 0.0
    steps = 0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if name == "infergate_sim_modelled_seconds_total":
                modelled += float(value)
            elif name == "infergate_sim_late_seconds_total":
                late += float(value)
            elif name == "infergate_sim_steps_total":
                steps += int(float(value))
    return modelled, late, steps


if __name__ == "__main__":
    main()
