"""SmolLM2-135M-Instruct (GGUF) on CPU: the engine's step loop vs transformers' `generate`.

Same file (fetched from PyPI, dequantized to float32 by each), same chat prompts, same
torch thread count, greedy, a fixed output length (EOS ignored). For each concurrency C,
C requests start together:

- engine: ``EngineCore`` (scheduler, paged KV cache, runner, detokenization; what the
  server runs, without HTTP), all C requests admitted at once;
- transformers: one ``generate`` call on the C prompts left-padded into a batch.

Output tok/s is C x length / wall time. TTFT is the mean time to each request's first
token (engine: per request; transformers: one prefill-plus-first-token call, which every
request of the batch waits for). Prints figures; asserts nothing.

    python benchmarks/smollm2_cpu.py [--concurrency 1 8 32] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from statistics import mean

import torch
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.fetch import fetch_model
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.interfaces import SamplingParams
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.tokenizer import Tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name three animals that live in the ocean.",
    "What is 12 times 7?",
]


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    def chat(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}])
        return tok.encode(text, add_special_tokens=False)

    return [chat(f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})") for i in range(n)]


def engine_run(
    model_dir: Path, tok: Tokenizer, batch: list[list[int]], tokens: int
) -> tuple[float, float]:
    """(output tok/s, mean TTFT s) of EngineCore with every request admitted at once."""
    blocks = len(batch) * (-(-(max(map(len, batch)) + tokens) // 16) + 1)
    runner = TorchModelRunner.from_model_dir(
        model_dir, block_size=16, num_blocks=blocks, device="cpu", dtype="float32",
        cpu_threads=torch.get_num_threads(),
    )  # fmt: skip
    core = EngineCore(
        runner, SchedulerConfig(max_num_seqs=len(batch), max_model_len=1024), tokenizer=tok
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    requests = [Request(str(i), list(p), params) for i, p in enumerate(batch)]
    start = time.perf_counter()
    for r in requests:
        core.add_request(r)
    while core.has_work():
        core.step()
    wall = time.perf_counter() - start
    ttft = mean((r.first_token_time or 0) - r.arrival_time for r in requests)
    return len(batch) * tokens / wall, ttft


def hf_run(
    hf: torch.nn.Module, batch: list[list[int]], tokens: int, pad: int
) -> tuple[float, float]:
    """(output tok/s, TTFT s) of one batched greedy `generate` (left padding)."""
    width = max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,  # type: ignore[operator]
                        min_new_tokens=n, pad_token_id=pad)  # fmt: skip
        return time.perf_counter() - start

    ttft = generate(1)
    return len(batch) * tokens / generate(tokens), ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = fetch_model("smollm2")
    model_dir = prepare_model_dir(gguf, Path(tempfile.mkdtemp(prefix="smollm2-bench-")))
    tok = Tokenizer(model_dir)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    print(f"SmolLM2-135M-Instruct Q4_1 -> float32, {args.tokens} output tokens, greedy, "
          f"{args.threads} torch thread(s), {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")  # fmt: skip
    print(f"{'C':>3} {'engine tok/s':>13} {'engine TTFT':>12} {'hf tok/s':>9} {'hf TTFT':>8}")
    engine_run(model_dir, tok, prompts(tok, 2), 4)  # warm-up (allocator, kernels)
    for c in args.concurrency:
        batch = prompts(tok, c)
        e_tps, e_ttft = engine_run(model_dir, tok, batch, args.tokens)
        h_tps, h_ttft = hf_run(hf, batch, args.tokens, pad=min(tok.eos_token_ids))
        print(
            f"{c:>3} {e_tps:>13.1f} {e_ttft * 1000:>10.0f}ms {h_tps:>9.1f} {h_ttft * 1000:>6.0f}ms"
        )


if __name__ == "__main__":
    main()
