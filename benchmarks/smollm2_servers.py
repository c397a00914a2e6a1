"""SmolLM2-135M-Instruct (GGUF) served over HTTP: `infergate engine serve` vs llama.cpp.

Both servers load the same GGUF file and get the same chat prompts through their OpenAI
chat-completions endpoints, streamed, greedy, with the same fixed output length: every
end-of-sequence token gets a ``logit_bias`` of -100, so each request generates exactly
``--tokens`` tokens on both (the benchmark checks the count). For each concurrency C, C
requests start together; output tok/s is the tokens received / wall time, TTFT the time to
each request's first content chunk (mean and max). The servers run one after the other
per concurrency level (never at the same time), with the same thread count.

The peer is llama.cpp through ``llama-cpp-python[server]`` (PyPI; builds llama.cpp from C++
source, in its own venv: ``--llama-python``). Its server runs one request at a time
(``--interrupt_requests False``: a new request waits instead of cutting the running one
off), so concurrency queues there; the engine batches continuously.

    python benchmarks/smollm2_servers.py --llama-python .venv-llamacpp/bin/python \
        [--concurrency 1 8 32] [--tokens 64] [--threads 2]

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import httpx
from infergate.engine.fetch import fetch_model
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.tokenizer import Tokenizer

from infergate.procs import ProcessGroup, free_port, http_ready

QUESTIONS = [
    "Tell me a long story about a dragon who learns to cook.",
    "Describe, in detail, a day in the life of a lighthouse keeper.",
    "Write a long letter to a friend about your trip to the mountains.",
    "Explain step by step how bread is made, with many details.",
    "Tell me everything you know about the history of ships.",
    "Describe a busy market in a big city, in many sentences.",
    "Write a long fairy tale about a clever fox and a wise owl.",
    "Explain how a garden changes through the four seasons.",
]


@dataclass
class Result:
    tok_s: float
    ttft_mean: float
    ttft_max: float
    tokens: int


async def one(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[float, int]:
    """(TTFT s, content chunks) of one streamed chat completion."""
    start = time.perf_counter()
    ttft, chunks = 0.0, 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0].get("delta", {}).get("content"):
                chunks += 1
                ttft = ttft or time.perf_counter() - start
    return ttft, chunks


async def measure(url: str, model: str, c: int, tokens: int, bias: dict[str, int]) -> Result:
    bodies = [
        {"model": model, "stream": True, "temperature": 0.0, "max_tokens": tokens,
         "logit_bias": bias,
         "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}]}
        for i in range(c)
    ]  # fmt: skip
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c)) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, url, b) for b in bodies))
        wall = time.perf_counter() - start
    received = sum(n for _, n in done)
    return Result(received / wall, mean(t for t, _ in done), max(t for t, _ in done), received)


def start_servers(group: ProcessGroup, gguf: Path, args: argparse.Namespace) -> dict[str, str]:
    """Both servers on free ports; name -> chat-completions URL."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    ours, theirs = free_port(), free_port()
    group.start(
        "infergate",
        [sys.executable, "-m", "infergate.cli", "engine", "serve", str(gguf),
         "--port", str(ours), "--served-model-name", "smollm2", "--device", "cpu",
         "--dtype", args.dtype, "--max-num-seqs", str(max(args.concurrency))],
        ready=http_ready(f"http://127.0.0.1:{ours}/health"), timeout=300, env=env,
    )  # fmt: skip
    group.start(
        "llama.cpp",
        [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
         "127.0.0.1", "--port", str(theirs), "--n_threads", str(args.threads),
         "--n_threads_batch", str(args.threads), "--n_ctx", "2048", "--model_alias", "smollm2",
         "--interrupt_requests", "False"],
        ready=http_ready(f"http://127.0.0.1:{theirs}/v1/models"), timeout=300, env=env,
    )  # fmt: skip
    return {
        "infergate": f"http://127.0.0.1:{ours}/v1/chat/completions",
        "llama.cpp": f"http://127.0.0.1:{theirs}/v1/chat/completions",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", required=True, help="python with llama-cpp-python[server]")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="the engine's --dtype (float16 halves the weight bytes each decode step streams)",
    )
    args = ap.parse_args()
    gguf = fetch_model("smollm2")
    tok = Tokenizer(prepare_model_dir(gguf, Path.home() / ".cache" / "infergate"))
    bias = {str(t): -100 for t in sorted(tok.eos_token_ids)}
    print(f"SmolLM2-135M-Instruct Q4_1, {args.tokens} output tokens, greedy, "
          f"{args.threads} threads each, {os.cpu_count()} CPUs, engine --dtype {args.dtype}")  # fmt: skip
    print(f"{'C':>3} {'server':>10} {'tok/s':>7} {'TTFT mean':>10} {'TTFT max':>9} {'tokens':>7}")
    with ProcessGroup() as group:
        urls = start_servers(group, gguf, args)
        for url in urls.values():  # warm-up: allocators, kernels, prompt templates
            asyncio.run(measure(url, "smollm2", 2, 4, bias))
        for c in args.concurrency:
            for name, url in urls.items():
                r = asyncio.run(measure(url, "smollm2", c, args.tokens, bias))
                print(f"{c:>3} {name:>10} {r.tok_s:>7.1f} {r.ttft_mean * 1000:>8.0f}ms "
                      f"{r.ttft_max * 1000:>7.0f}ms {r.tokens:>7}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
