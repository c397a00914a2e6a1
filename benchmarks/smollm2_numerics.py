"""SmolLM2-135M-Instruct (GGUF): the engine's greedy tokens and logprobs against llama.cpp's.

Eight chat prompts that no test uses, rendered by the GGUF's chat template into token ids,
go to every system as the same ids; each generates ``--tokens`` tokens greedily with
end-of-sequence ignored:

- **engine**: ``infergate engine serve`` (its defaults plus ``--engine-arg``), through
  ``/v1/completions`` with ``logprobs`` and ``return_token_ids``;
- **llama.cpp**: ``llama_cpp.Llama`` on the same GGUF, in ``--llama-python``'s venv (one
  token at a time, argmax of its logits);
- optionally a **reference engine** (``--reference-engine-arg``, e.g. the float32
  dequantized path), through the same endpoint.

Each system also scores the engine's own tokens teacher-forced (llama.cpp: one pass over
prompt + the engine's tokens; a reference engine: ``prompt_logprobs``), so logprobs are
compared on the same contexts at every position, past any divergence. Per pair:

- **greedy agreement**: tokens identical up to the first divergence, as a share of
  ``--tokens`` (mean over prompts), and the share of prompts whose tokens all agree;
- **teacher-forced top-1**: the share of the engine's contexts where both pick the same
  next token;
- **|Δ logprob|**: mean and max absolute difference of the engine's tokens' logprobs.

Only one system is loaded at a time. Prints a table; asserts nothing.

    python benchmarks/smollm2_numerics.py --llama-python .venv-llamacpp/bin/python \
        [--tokens 64] [--threads 2] [--reference-engine-arg=--dtype=float32 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import httpx
from infergate.engine.fetch import fetch_model
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.tokenizer import Tokenizer
from rich.console import Console
from rich.table import Table

from infergate.procs import ProcessGroup, free_port, http_ready

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What is 17 multiplied by 23? Show your working step by step.",
    "Translate into French: 'The train to Lyon leaves at seven in the morning.'",
    "List five uses of copper and say why each one needs copper.",
    "Summarize the plot of Romeo and Juliet for a ten-year-old.",
    "Write a short poem about a cat watching rain through a window.",
    "Give a JSON object describing a book with title, author, year and genres.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
]

#: Runs under ``--llama-python``: greedy generation, then the engine's tokens scored in
#: one pass (``logits_all``), for each prompt; JSON in on stdin, JSON out on stdout.
_LLAMA = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

req = json.load(sys.stdin)
llm = Llama(model_path=req["gguf"], n_ctx=req["n_ctx"], n_threads=req["threads"],
            n_threads_batch=req["threads"], logits_all=True, verbose=False)

def logsoftmax(row):
    row = row.astype(np.float64)
    top = row.max()
    return row - top - np.log(np.exp(row - top).sum())

out = []
for prompt, forced in zip(req["prompts"], req["forced"]):
    llm.reset()
    llm.eval(prompt)
    greedy = []
    for _ in range(req["tokens"]):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(token)
        llm.eval([token])
    llm.reset()
    llm.eval(prompt + forced)
    rows = [logsoftmax(llm.scores[len(prompt) - 1 + i]) for i in range(len(forced))]
    out.append({"greedy": greedy, "logprobs": [float(r[t]) for r, t in zip(rows, forced)],
                "top": [int(r.argmax()) for r in rows]})
json.dump(out, sys.stdout)
"""


@dataclass
class Scored:
    """One system on one prompt: its own greedy tokens, and on the engine's tokens (teacher
    forced) each token's logprob and its own top-1 choice."""

    greedy: list[int]
    logprobs: list[float]
    top: list[int]


def chat_ids(tok: Tokenizer) -> list[list[int]]:
    def ids(q: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": q}])
        return tok.encode(text, add_special_tokens=False)

    return [ids(q) for q in PROMPTS]


def engine_generate(base: str, prompt: list[int], tokens: int) -> Scored:
    """Greedy tokens and their logprobs from the engine's completions endpoint."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True}  # fmt: skip
    choice = httpx.post(f"{base}/v1/completions", json=body, timeout=600).json()["choices"][0]
    ids = choice["token_ids"]
    return Scored(ids, choice["logprobs"]["token_logprobs"], ids)


def engine_score(base: str, prompt: list[int], forced: list[int]) -> list[tuple[float, int]]:
    """(logprob, top-1 token) of each forced token, from ``prompt_logprobs``."""
    body = {"model": "smollm2", "prompt": prompt + forced, "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": 1}  # fmt: skip
    choice = httpx.post(f"{base}/v1/completions", json=body, timeout=600).json()["choices"][0]
    entries = choice["prompt_logprobs"][len(prompt) :]
    return [
        (entry[str(t)]["logprob"], next(int(k) for k, v in entry.items() if v["rank"] == 1))
        for entry, t in zip(entries, forced, strict=True)
    ]


def run_engine(
    gguf: Path, prompts: list[list[int]], args: argparse.Namespace, extra: list[str],
    forced: list[list[int]] | None,
) -> list[Scored]:  # fmt: skip
    """One engine up: each prompt's greedy tokens and, given `forced` (the candidate's
    tokens), its logprobs and top-1 on them; without `forced` it is the candidate."""
    port = args.port or free_port()
    argv = [sys.executable, "-m", "infergate.cli", "engine", "serve", str(gguf), "--port",
            str(port), "--served-model-name", "smollm2", "--device", "cpu", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    base = f"http://127.0.0.1:{port}"
    with ProcessGroup() as group:
        group.start("engine", argv, ready=http_ready(f"{base}/health"), timeout=600, env=env)
        runs = [engine_generate(base, p, args.tokens) for p in prompts]
        if forced is None:
            return runs
        for run, p, f in zip(runs, prompts, forced, strict=True):
            scores = engine_score(base, p, f)
            run.logprobs, run.top = [s[0] for s in scores], [s[1] for s in scores]
        return runs


def run_llama(
    gguf: Path, prompts: list[list[int]], forced: list[list[int]], args: argparse.Namespace
) -> list[Scored]:
    """llama.cpp's greedy tokens and its scores of the engine's tokens (a subprocess in
    the llama-cpp-python venv: a different Python from this one)."""
    request = {"gguf": str(gguf), "threads": args.threads, "tokens": args.tokens,
               "n_ctx": max(map(len, prompts)) + 2 * args.tokens, "prompts": prompts,
               "forced": forced}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run([args.llama_python, "-c", _LLAMA], input=json.dumps(request),
                          capture_output=True, text=True, check=True, env=env)  # fmt: skip
    return [Scored(r["greedy"], r["logprobs"], r["top"]) for r in json.loads(done.stdout)]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def pair_row(name: str, a: list[Scored], b: list[Scored], tokens: int) -> list[str]:
    """The table's figures for systems `a` and `b` over all prompts."""
    agree = [first_divergence(x.greedy, y.greedy) / tokens for x, y in zip(a, b, strict=True)]
    exact = sum(x.greedy == y.greedy for x, y in zip(a, b, strict=True)) / len(a)
    tops = [s == t for x, y in zip(a, b, strict=True) for s, t in zip(x.top, y.top, strict=True)]
    deltas = [abs(s - t) for x, y in zip(a, b, strict=True)
              for s, t in zip(x.logprobs, y.logprobs, strict=True)]  # fmt: skip
    return [name, f"{sum(agree) / len(agree):.1%}", f"{exact:.0%}", f"{sum(tops) / len(tops):.1%}",
            f"{sum(deltas) / len(deltas):.4f}", f"{max(deltas):.4f}"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--llama-python", required=True, help="python with llama-cpp-python")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra `engine serve` "
                    "argument for the engine under test")  # fmt: skip
    ap.add_argument("--reference-engine-arg", action="append", default=[],
                    help="`engine serve` argument of a reference engine (e.g. the float32 "
                    "dequantized path); without any, no reference engine runs")  # fmt: skip
    ap.add_argument("--port", type=int, default=0, help="the engines' port (default: free)")
    args = ap.parse_args()
    gguf = fetch_model("smollm2")
    tok = Tokenizer(prepare_model_dir(gguf, Path.home() / ".cache" / "infergate"))
    prompts = chat_ids(tok)
    systems = {"engine": run_engine(gguf, prompts, args, args.engine_arg, None)}
    forced = [s.greedy for s in systems["engine"]]
    if args.reference_engine_arg:
        name = "engine " + " ".join(args.reference_engine_arg)
        systems[name] = run_engine(gguf, prompts, args, args.reference_engine_arg, forced)
    systems["llama.cpp"] = run_llama(gguf, prompts, forced, args)
    table = Table(title=f"SmolLM2 Q4_1, {len(prompts)} prompts × {args.tokens} greedy tokens; "
                  "logprobs on the engine's tokens", title_justify="left")  # fmt: skip
    for col in ("pair", "greedy agreement", f"all {args.tokens} equal", "teacher-forced top-1",
                "mean |Δ logprob|", "max |Δ logprob|"):  # fmt: skip
        table.add_column(col, justify="right")
    for (na, a), (nb, b) in combinations(systems.items(), 2):
        table.add_row(*pair_row(f"{na} vs {nb}", a, b, args.tokens))
    Console(width=160).print(table)
    for q, e, ll in zip(PROMPTS, systems["engine"], systems["llama.cpp"], strict=True):
        d = first_divergence(e.greedy, ll.greedy)
        print(f"{q[:50]!r}: diverge at {d}; engine {tok.decode(e.greedy[:d + 8])!r}"
              f" / llama.cpp {tok.decode(ll.greedy[:d + 8])!r}"[:400])  # fmt: skip


if __name__ == "__main__":
    main()
