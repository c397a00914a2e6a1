"""CPU decode throughput of the real engine on the tiny model, at batch 1 and 32.

A third view: EngineCore throughput by sampling mode (greedy; temperature with top-p;
the same with presence/frequency/repetition penalties, min-p, a logit bias and top-5
logprobs on every request; and json_schema: every request under an xgrammar JSON-schema
grammar, an unbounded array of integers, so it runs the full length), so the cost of
the batched penalty and grammar-bitmask paths shows next to plain sampling.

Two views: the bare `TorchModelRunner` (prefill once, then timed decode steps over the
paged KV cache), and the whole `EngineCore` step loop (scheduler + KV manager + runner +
detokenization) generating the same number of tokens. Prints figures; asserts nothing.

    python benchmarks/engine_cpu.py [--model DIR] [--batch 1 32] [--steps 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from infergate.engine.interfaces import SamplingParams, ScheduledBatch, ScheduledSeq
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.tiny_model import make_tiny_model

PROMPT_LEN = 32


def runner_decode(model_dir: Path, batch: int, steps: int, block_size: int) -> tuple[float, float]:
    """(decode tokens/s, ms per step) of the bare runner."""
    blocks_per_seq = -(-(PROMPT_LEN + steps + 1) // block_size)
    runner = TorchModelRunner.from_model_dir(
        model_dir, block_size=block_size, num_blocks=batch * blocks_per_seq, device="cpu"
    )
    greedy = SamplingParams(temperature=0.0)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompts = [[(7 * i + j) % 200 + 10 for j in range(PROMPT_LEN)] for i in range(batch)]
    last = runner.execute(
        ScheduledBatch(
            [ScheduledSeq(f"r{i}", prompts[i], 0, tables[i], True, greedy) for i in range(batch)]
        )
    )
    warmup = 3
    start = 0.0
    for step in range(steps + warmup):
        if step == warmup:
            start = time.perf_counter()
        pos = PROMPT_LEN + step
        seqs = [
            ScheduledSeq(f"r{i}", [int(last[i] or 0)], pos, tables[i], True, greedy, step + 1)
            for i in range(batch)
        ]
        last = runner.execute(ScheduledBatch(seqs))
    elapsed = time.perf_counter() - start
    return batch * steps / elapsed, 1000 * elapsed / steps


SAMPLING_MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "random": {"temperature": 1.0, "top_p": 0.9, "seed": 1},
    "penalties+logprobs": {
        "temperature": 1.0, "top_p": 0.9, "seed": 1, "presence_penalty": 0.5,
        "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.05,
        "logit_bias": tuple((t, 2.0) for t in range(10, 15)), "logprobs": 5,
    },
    "json_schema": {"temperature": 1.0, "top_p": 0.9, "seed": 1},  # + a grammar, below
}  # fmt: skip
GRAMMAR_SCHEMA = '{"type": "array", "items": {"type": "integer"}}'


def grammar_states(model_dir: Path, vocab_size: int, count: int) -> list[Any]:
    """`count` fresh matchers of the benchmark's JSON-schema grammar (compiled once)."""
    from infergate.engine.structured_output import GrammarSpec
    from infergate.engine.structured_output.compiler import GrammarCompiler
    from infergate.engine.structured_output.matcher import GrammarState
    from infergate.engine.tokenizer import Tokenizer

    compiler = GrammarCompiler(Tokenizer(model_dir), vocab_size)
    compiled = compiler.compile_sync(GrammarSpec("json", GRAMMAR_SCHEMA, "bench"))
    compiler.shutdown()
    return [GrammarState(compiled) for _ in range(count)]


def engine_decode(
    model_dir: Path, batch: int, steps: int, block_size: int, mode: str = "greedy"
) -> float | None:
    """Output tokens/s through EngineCore (prefill included), or None if it is absent."""
    try:
        from infergate.engine.core.engine_core import EngineCore
        from infergate.engine.core.request import Request
        from infergate.engine.core.scheduler import SchedulerConfig
        from infergate.engine.tokenizer import Tokenizer
    except ImportError:
        return None
    runner = TorchModelRunner.from_model_dir(model_dir, block_size=block_size, device="cpu")
    core = EngineCore(
        runner,
        SchedulerConfig(max_num_seqs=max(batch, 1), max_model_len=runner.max_model_len),
        tokenizer=Tokenizer(model_dir),
    )
    extra: dict[str, Any] = dict(SAMPLING_MODES[mode])
    params = SamplingParams(max_tokens=steps, ignore_eos=True, **extra)
    grammars: list[Any] = [None] * batch
    if mode == "json_schema":
        grammars = grammar_states(model_dir, runner.vocab_size, batch)
    for i in range(batch):
        prompt = [(7 * i + j) % 200 + 10 for j in range(PROMPT_LEN)]
        core.add_request(Request(f"e{i}", prompt, params, grammar=grammars[i]))
    produced = 0
    start = time.perf_counter()
    while core.has_work():
        produced += sum(len(o.new_token_ids) for o in core.step())
    return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model dir (default: a fresh tiny llama)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="report the best of N runs")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_tiny_model(Path(tmp) / "tiny", arch="llama")
        print(
            f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
            f"torch {torch.__version__}, model {model_dir.name}, "
            f"prompt {PROMPT_LEN} tokens, {args.steps} decode steps, best of {args.repeat}"
        )
        print(f"{'batch':>5}  {'runner tok/s':>12}  {'ms/step':>8}  {'EngineCore tok/s':>16}")
        for b in args.batch:
            # Best of N: the figure least disturbed by other load on the machine.
            tps, ms = max(
                runner_decode(model_dir, b, args.steps, args.block_size) for _ in range(args.repeat)
            )
            cores = [
                engine_decode(model_dir, b, args.steps, args.block_size) for _ in range(args.repeat)
            ]
            core = max((c for c in cores if c is not None), default=None)
            core_s = f"{core:16.0f}" if core is not None else f"{'n/a':>16}"
            print(f"{b:>5}  {tps:12.0f}  {ms:8.2f}  {core_s}")
        print()
        print(f"{'batch':>5}  " + "  ".join(f"{m + ' tok/s':>24}" for m in SAMPLING_MODES))
        for b in args.batch:
            row = []
            for mode in SAMPLING_MODES:
                runs = [
                    engine_decode(model_dir, b, args.steps, args.block_size, mode)
                    for _ in range(args.repeat)
                ]
                best = max((r for r in runs if r is not None), default=None)
                row.append(f"{best:24.0f}" if best is not None else f"{'n/a':>24}")
            print(f"{b:>5}  " + "  ".join(row))
        print(f"# torch intra-op threads during the runs: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
