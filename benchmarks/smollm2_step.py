"""SmolLM2-135M-Instruct (Q4_1 GGUF) decode step time on CPU, per ``--quantization``.

The bare ``TorchModelRunner`` (no scheduler, no HTTP): B sequences prefill a 32-token
prompt, then decode greedily; each decode step is timed alone. Every quantization is
loaded once and the batches run interleaved round by round, so both paths see the same
machine load; the figure is the median step of the best round (the least disturbed by
other work on a shared machine). Also prints each runner's weight bytes. Asserts nothing.

    python benchmarks/smollm2_step.py [--batch 1 8 32] [--steps 32] [--rounds 3]
        [--quantization gguf none] [--kv-cache-dtype bfloat16 float32] [--threads 2]
        [--profile gguf:1] [--kernels]

To time an older checkout the same way: ``git archive REV engine infergate | tar -x -C
DIR && mv DIR/engine DIR/infergate/engine`` (``infergate.engine`` is ``engine/`` only in
an install), then ``PYTHONPATH=DIR python benchmarks/smollm2_step.py`` (add
``--quantization default`` for a checkout from before that flag).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from infergate.engine.fetch import fetch_model
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.interfaces import SamplingParams, ScheduledBatch, ScheduledSeq
from infergate.engine.model_runner import TorchModelRunner

PROMPT_LEN = 32
BLOCK = 16


def decode_steps(
    runner: TorchModelRunner, batch: int, steps: int, around: Any = None
) -> list[float]:
    """Seconds of each of `steps` greedy decode steps of `batch` sequences (run inside
    the context manager `around`, when given: the prefill is left out)."""
    per_seq = -(-(PROMPT_LEN + steps + 1) // BLOCK)
    greedy = SamplingParams(temperature=0.0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[(7 * i + j) % 200 + 10 for j in range(PROMPT_LEN)] for i in range(batch)]
    seqs = [ScheduledSeq(f"r{i}", prompts[i], 0, tables[i], True, greedy) for i in range(batch)]
    last = runner.execute(ScheduledBatch(seqs))
    times = []
    with around or contextlib.nullcontext():
        times = _timed_steps(runner, last, tables, steps, greedy)
    return times


def _timed_steps(
    runner: TorchModelRunner,
    last: list[int | None],
    tables: list[list[int]],
    steps: int,
    greedy: SamplingParams,
) -> list[float]:
    batch, times = len(tables), []
    for step in range(steps):
        seqs = [
            ScheduledSeq(f"r{i}", [int(last[i] or 0)], PROMPT_LEN + step, tables[i], True,
                         greedy, step + 1)
            for i in range(batch)
        ]  # fmt: skip
        start = time.perf_counter()
        last = runner.execute(ScheduledBatch(seqs))
        times.append(time.perf_counter() - start)
    return times


def weight_bytes(runner: TorchModelRunner) -> int:
    """Bytes of the model's parameters and buffers (shared tensors once)."""
    seen = {}
    for t in [*runner.model.parameters(), *runner.model.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def profile(runner: TorchModelRunner, batch: int, steps: int) -> None:
    """torch.profiler's table of the ops of `steps` decode steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decode_steps(runner, batch, 2)
    prof = torch_profile(activities=[ProfilerActivity.CPU])
    decode_steps(runner, batch, steps, around=prof)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


#: SmolLM2's projections (rows, columns), the lm_head's blocks Q8_0, the others Q4_1.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # fmt: skip


def _best_us(fn: Any, *args: Any) -> float:
    """Fastest of the calls of `fn(*args)` made in 0.3 s, in microseconds."""
    fn(*args)
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < 0.3:
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return 1e6 * min(times)


def kernels(batches: list[int]) -> None:
    """One projection of each SmolLM2 shape: F.linear on float32 weights against the
    quantized linear (and, at M=1, the int4 kernel's float32-activation path, which is
    scalar); weights stay in cache here, unlike in a 135M model's step."""
    import gguf
    import numpy as np
    from infergate.engine.models.quantized import QuantizedLinear, QuantizedTensor, pack_int4
    from torch.nn import functional as F

    int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    print(f"{'shape':>8} {'M':>3} {'f32 us':>9} {'packed us':>10} {'f32-act int4 us':>16}")
    for name, (rows, cols) in SHAPES.items():
        qtype = gguf.GGMLQuantizationType["Q8_0" if name == "lm_head" else "Q4_1"]
        values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        raw = torch.from_numpy(gguf.quants.quantize(values * 0.05, qtype))
        q = QuantizedTensor(qtype.name, raw, (rows, cols))
        dense = q.dequantize()
        linear = QuantizedLinear(cols, rows)
        linear.load_part(0, q)
        packed, sz, wide = pack_int4([q])
        for m in batches:
            x = torch.randn(m, cols)
            xw = torch.cat([x, x], dim=-1) if wide else x
            slow = f"{_best_us(int4_mm, xw, packed, 32, sz):16.0f}" if m == 1 else ""
            f32, ours = _best_us(F.linear, x, dense), _best_us(linear, x)
            print(f"{name:>8} {m:>3} {f32:9.0f} {ours:10.0f} {slow}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", nargs="+", default=["gguf", "none"])
    ap.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        help="one runner per dtype and quantization",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--profile", help="QUANTIZATION:BATCH: print an op profile instead")
    ap.add_argument("--kernels", action="store_true", help="time single projections instead")
    args = ap.parse_args()
    if args.kernels:
        torch.set_num_threads(args.threads)
        kernels(args.batch)
        return
    gguf = fetch_model("smollm2")
    model_dir = prepare_model_dir(gguf, Path(tempfile.mkdtemp(prefix="smollm2-step-")))
    blocks = max(args.batch) * (-(-(PROMPT_LEN + args.steps + 1) // BLOCK))
    # "default" passes no --quantization: the runner's own default, which lets this script
    # time a checkout from before the flag existed (float32) against this one.
    runners = {
        q if len(args.kv_cache_dtype) == 1 else f"{q}/kv-{kv}": TorchModelRunner.from_model_dir(
            model_dir, block_size=BLOCK, num_blocks=blocks, device="cpu", dtype="float32",
            cpu_threads=args.threads, **({} if q == "default" else {"quantization": q}),
            **({} if kv == "auto" else {"kv_cache_dtype": kv}),
        )
        for q in args.quantization
        for kv in args.kv_cache_dtype
    }  # fmt: skip
    if args.profile:
        q, b = args.profile.split(":")
        profile(runners[q], int(b), args.steps)
        return
    print(f"# SmolLM2-135M-Instruct Q4_1, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} "
          f"threads, {args.steps} decode steps, median step of the best of {args.rounds} rounds")  # fmt: skip
    for q, r in runners.items():
        print(f"# --quantization {q}: weights {weight_bytes(r) / 2**20:.0f} MiB")
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for b in args.batch:
            for q, r in runners.items():
                ms = 1000 * statistics.median(decode_steps(r, b, args.steps))
                best[q, b] = min(best.get((q, b), ms), ms)
    print(f"{'batch':>5}  " + "  ".join(f"{q + ' ms/step':>14}  {'tok/s':>7}" for q in runners))
    for b in args.batch:
        row = [f"{best[q, b]:14.2f}  {1000 * b / best[q, b]:7.0f}" for q in runners]
        print(f"{b:>5}  " + "  ".join(row))


if __name__ == "__main__":
    main()
