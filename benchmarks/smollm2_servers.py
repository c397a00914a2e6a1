"""SmolLM2-135M-Instruct (GGUF) served over HTTP: `infergate engine serve` vs llama.cpp.

Both servers load the same GGUF file, with the same thread count, and get the same chat
prompts through their OpenAI chat-completions endpoints, streamed, greedy, with the same
fixed output length: every end-of-sequence token gets a ``logit_bias`` of -100, so each
request generates exactly ``--tokens`` tokens on both (the table shows the count). Per
server and round:

- **output tok/s at concurrency C**: C requests start together; tokens received / wall
  time. The prompts are ~40 tokens, so this is decode throughput; TTFT (mean, max) is the
  time to each request's first content chunk;
- **TTFT of a 1k prompt**: one streamed ``/v1/completions`` request at a time with a
  fresh 1,024-token prompt (each repeat starts differently, so no prefix cache helps),
  one output token; the median of ``--ttft-repeats``;
- **RSS**: the peak resident set of the server's process tree (sum over the processes,
  sampled every 0.1 s while it serves) and the sum of the kernel's per-process high-water
  marks (``VmHWM``, loading included), the highest over the round's measurements.

Only one server is loaded at a time: each measurement (the 1k TTFTs, each concurrency)
starts a server, warms it up, measures and stops it, then does the same on the other
server, so that the two figures of a pair are taken minutes apart at most (odd rounds start
with the other server). Each round ends with transformers' ``generate`` in this process
at concurrency 1 on the same GGUF dequantized to float32, with ``--threads`` torch threads
(``smollm2_cpu.hf_run``). On a shared machine run two rounds: the ratios of one round are
the comparable figures. Both servers get ``OMP_NUM_THREADS=--threads`` (the engine's CPU
threads) and llama.cpp ``--n_threads``/``--n_threads_batch``, and the same context length
(``CONTEXT``: llama.cpp's ``--n_ctx``, the engine's ``--max-model-len``).

The peer is llama.cpp through ``llama-cpp-python[server]`` (``make llamacpp``; builds
llama.cpp from C++ source, in its own venv: ``--llama-python``). Its server runs one
request at a time (``--interrupt_requests False``: a new request waits instead of cutting
the running one off), so concurrency queues there; the engine batches continuously.

    python benchmarks/smollm2_servers.py --llama-python .venv-llamacpp/bin/python \
        [--concurrency 1 8 32] [--tokens 64] [--threads 2] [--rounds 2] \
        [--engine-arg=--dtype=float16 ...] [--result-file out.json]

Prints figures and the issue's targets (met or missed); asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean, median

import httpx
import psutil
from infergate.engine.fetch import fetch_model
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.tokenizer import Tokenizer
from rich.console import Console
from rich.table import Table

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

#: The issue's targets: engine / llama.cpp output tok/s at each concurrency (at least),
#: TTFT of the 1k prompt and peak RSS as engine / llama.cpp (at most), and the engine at
#: concurrency 1 / transformers' generate (at least).
TOK_S_TARGETS = {1: 1.0, 8: 1.5, 32: 2.0}
TTFT_1K_TARGET = 1.0
RSS_TARGET = 1.5
HF_TARGET = 4.5

_WORDS = str.split(
    "river stone market window garden morning winter bread ship harbor lantern mountain "
    "letter quiet golden ancient village forest silver candle travel music summer story "
    "engine careful bright wooden kitchen distant friend north copper valley paper cloud "
    "orange simple number table mirror thunder school bridge meadow castle pocket field"
)


@dataclass
class Load:
    """One concurrency level on one server."""

    tok_s: float
    ttft_mean: float
    ttft_max: float
    tokens: int


@dataclass
class ServerRun:
    """What one server measured in one round."""

    loads: dict[int, Load] = field(default_factory=dict)
    ttft_1k: list[float] = field(default_factory=list)
    rss_peak: int = 0
    rss_hwm: int = 0


async def one(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[float, int]:
    """(TTFT s, content chunks) of one streamed chat completion or completion."""
    start = time.perf_counter()
    ttft, chunks = 0.0, 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and (choices[0].get("delta", {}).get("content") or "text" in choices[0]):
                chunks += 1
                ttft = ttft or time.perf_counter() - start
    return ttft, chunks


async def measure(base: str, c: int, tokens: int, bias: dict[str, int]) -> Load:
    """C streamed chat completions started together."""
    bodies = [
        {"model": "smollm2", "stream": True, "temperature": 0.0, "max_tokens": tokens,
         "logit_bias": bias,
         "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}]}
        for i in range(c)
    ]  # fmt: skip
    url = f"{base}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=c)) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, url, b) for b in bodies))
        wall = time.perf_counter() - start
    received = sum(n for _, n in done)
    return Load(received / wall, mean(t for t, _ in done), max(t for t, _ in done), received)


def long_prompts(tok: Tokenizer, n: int, length: int) -> list[str]:
    """`n` texts of `length` tokens (by this tokenizer, which is the GGUF's), each with its
    own first words so that no server's prefix cache shortens the next one's prefill."""
    texts = []
    for seed in range(n):
        rng = random.Random(seed)
        words = " ".join(rng.choice(_WORDS) for _ in range(2 * length))
        ids = tok.encode(f"Note {seed}: {words}", add_special_tokens=False)[:length]
        texts.append(tok.decode(ids))
    return texts


async def ttft_1k(base: str, prompts: list[str], bias: dict[str, int]) -> list[float]:
    """TTFT of each prompt, one at a time (one output token)."""
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        return [
            (await one(client, url, {"model": "smollm2", "prompt": p, "max_tokens": 1,
                                     "stream": True, "temperature": 0.0, "logit_bias": bias}))[0]
            for p in prompts
        ]  # fmt: skip


class PeakRss:
    """The peak RSS of a process tree, sampled on a thread while the `with` block runs."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.root, self.interval, self.peak = psutil.Process(pid), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def tree(self) -> list[psutil.Process]:
        return [self.root, *self.root.children(recursive=True)]

    def rss(self) -> int:
        total = 0
        for proc in self.tree():
            with suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
        return total

    def hwm(self) -> int:
        """Sum of the processes' VmHWM (kB in /proc/PID/status), in bytes."""
        total = 0
        for proc in self.tree():
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except FileNotFoundError:
                continue
            total += 1024 * next(
                int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")
            )
        return total

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> PeakRss:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


#: Both servers' context length (llama.cpp's ``--n_ctx``, the engine's ``--max-model-len``).
CONTEXT = 2048


def server_argv(name: str, gguf: Path, port: int, args: argparse.Namespace) -> list[str]:
    """The command line of one server, both on the same GGUF, thread count and context."""
    if name == "engine":
        return [sys.executable, "-m", "infergate.cli", "engine", "serve", str(gguf),
                "--port", str(port), "--served-model-name", "smollm2", "--device", "cpu",
                "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", str(CONTEXT),
                *args.engine_arg]  # fmt: skip
    return [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
            "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads),
            "--n_threads_batch", str(args.threads), "--n_ctx", str(CONTEXT), "--model_alias",
            "smollm2", "--interrupt_requests", "False"]  # fmt: skip


@contextmanager
def serving(
    name: str, gguf: Path, port: int, args: argparse.Namespace
) -> Iterator[tuple[str, int]]:
    """One server up (base URL, pid) for the `with` block, then stopped."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    ready = "/health" if name == "engine" else "/v1/models"
    with ProcessGroup() as group:
        proc = group.start(
            name, server_argv(name, gguf, port, args),
            ready=http_ready(f"http://127.0.0.1:{port}{ready}"), timeout=600, env=env,
        )  # fmt: skip
        yield f"http://127.0.0.1:{port}", proc.pid


def run_phase(
    name: str, phase: int | None, gguf: Path, args: argparse.Namespace, bias: dict[str, int],
    prompts_1k: list[str], run: ServerRun,
) -> None:  # fmt: skip
    """One server started for one measurement (`phase`: a concurrency, or None for the 1k
    TTFTs), warmed up, measured under the RSS sampler into `run`, and stopped."""
    with serving(name, gguf, args.port or free_port(), args) as (base, pid), PeakRss(pid) as rss:
        # Allocators, kernels, prompt templates: one request of the measured length, then
        # two at once (a fresh engine's first ~100 steps ran slower); both get the same.
        asyncio.run(measure(base, 1, args.tokens, bias))
        asyncio.run(measure(base, 2, 4, bias))
        if phase is None:
            asyncio.run(ttft_1k(base, prompts_1k[:1], bias))
            run.ttft_1k = asyncio.run(ttft_1k(base, prompts_1k[1:], bias))
            print(f"  {name}: TTFT 1k median {median(run.ttft_1k) * 1000:.0f} ms", flush=True)
        else:
            run.loads[phase] = load = asyncio.run(measure(base, phase, args.tokens, bias))
            print(f"  {name}: C={phase} {load.tok_s:.1f} tok/s, {load.tokens} tokens", flush=True)
        run.rss_peak, run.rss_hwm = max(run.rss_peak, rss.peak), max(run.rss_hwm, rss.hwm())


def run_round(
    index: int, servers: list[str], gguf: Path, args: argparse.Namespace,
    bias: dict[str, int], prompts_1k: list[str],
) -> dict[str, ServerRun]:  # fmt: skip
    """Each measurement on each server in turn, so that the two figures of a pair are
    minutes apart at most on a shared machine; odd rounds start with the other server."""
    runs = {s: ServerRun() for s in servers}
    order = servers if index % 2 == 0 else servers[::-1]
    for phase in [None, *args.concurrency]:
        for name in order:
            run_phase(name, phase, gguf, args, bias, prompts_1k, runs[name])
    return runs


class Transformers:
    """transformers' `generate` at concurrency 1 in this process (float32, `threads`)."""

    def __init__(self, gguf: Path, tok: Tokenizer, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        text = tok.apply_chat_template([{"role": "user", "content": f"{QUESTIONS[0]} (0)"}])
        self.prompt = tok.encode(text, add_special_tokens=False)
        self.pad = min(tok.eos_token_ids)

    def tok_s(self, tokens: int) -> float:
        from smollm2_cpu import hf_run  # benchmarks/smollm2_cpu.py, beside this script

        return hf_run(self.model, [self.prompt], tokens, self.pad)[0]


def verdict(ratio: float, target: float, at_least: bool) -> str:
    """'met' or how far from the target, as a factor."""
    if (ratio >= target) if at_least else (ratio <= target):
        return "[green]met[/green]"
    return f"[red]missed by {target / ratio if at_least else ratio / target:.2f}×[/red]"


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def tok_s_table(rounds: list[dict[str, ServerRun]], concurrency: list[int]) -> Table:
    table = Table(title="output tok/s (engine / llama.cpp: target at least)", title_justify="left")
    for col in ("round", "C", "engine tok/s", "llama.cpp tok/s", "ratio", "target", "",
                "engine TTFT mean", "llama.cpp TTFT mean", "tokens"):  # fmt: skip
        table.add_column(col, justify="right")
    for i, r in enumerate(rounds, 1):
        for c in concurrency:
            e, ll = r["engine"].loads[c], r["llama.cpp"].loads[c]
            ratio, target = e.tok_s / ll.tok_s, TOK_S_TARGETS.get(c, 1.0)
            table.add_row(str(i), str(c), f"{e.tok_s:.1f}", f"{ll.tok_s:.1f}", f"{ratio:.2f}×",
                          f"≥ {target:g}×", verdict(ratio, target, True),
                          f"{e.ttft_mean * 1000:,.0f} ms", f"{ll.ttft_mean * 1000:,.0f} ms",
                          f"{e.tokens} / {ll.tokens}")  # fmt: skip
    return table


def ttft_rss_table(rounds: list[dict[str, ServerRun]]) -> Table:
    table = Table(title="TTFT of a 1,024-token prompt (median) and RSS", title_justify="left")
    for col in ("round", "engine TTFT 1k", "llama.cpp TTFT 1k", "ratio", "",
                "engine RSS peak", "llama.cpp RSS peak", "ratio", "",
                "engine VmHWM", "llama.cpp VmHWM"):  # fmt: skip
        table.add_column(col, justify="right")
    for i, r in enumerate(rounds, 1):
        e, ll = r["engine"], r["llama.cpp"]
        t_ratio = median(e.ttft_1k) / median(ll.ttft_1k)
        m_ratio = e.rss_peak / ll.rss_peak
        table.add_row(str(i), f"{median(e.ttft_1k) * 1000:,.0f} ms",
                      f"{median(ll.ttft_1k) * 1000:,.0f} ms", f"{t_ratio:.2f}×",
                      verdict(t_ratio, TTFT_1K_TARGET, False), mib(e.rss_peak), mib(ll.rss_peak),
                      f"{m_ratio:.2f}×", verdict(m_ratio, RSS_TARGET, False), mib(e.rss_hwm),
                      mib(ll.rss_hwm))  # fmt: skip
    return table


def engine_only_table(rounds: list[dict[str, ServerRun]], hf: list[float]) -> Table:
    """The engine's figures and transformers at concurrency 1 (no llama.cpp needed)."""
    table = Table(title="engine over HTTP vs transformers generate at concurrency 1",
                  title_justify="left")  # fmt: skip
    for col in ("round", "engine C=1 tok/s", "transformers tok/s", "ratio", "target", "",
                "engine TTFT 1k", "engine RSS peak"):  # fmt: skip
        table.add_column(col, justify="right")
    for i, (r, h) in enumerate(zip(rounds, hf, strict=True), 1):
        e = r["engine"]
        ratio = e.loads[1].tok_s / h
        table.add_row(str(i), f"{e.loads[1].tok_s:.1f}", f"{h:.1f}", f"{ratio:.2f}×",
                      f"≥ {HF_TARGET:g}×", verdict(ratio, HF_TARGET, True),
                      f"{median(e.ttft_1k) * 1000:,.0f} ms", mib(e.rss_peak))  # fmt: skip
    return table


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--llama-python", help="python with llama-cpp-python[server]; without it, "
                    "only the engine and transformers run")  # fmt: skip
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's and torch's threads")
    ap.add_argument("--rounds", type=int, default=2, help="every measurement this many times")
    ap.add_argument("--ttft-repeats", type=int, default=5, help="1k prompts per median")
    ap.add_argument("--ttft-tokens", type=int, default=1024, help="the long prompt's tokens")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra `engine serve` argument, e.g. --engine-arg=--dtype=float16")  # fmt: skip
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers")
    ap.add_argument("--port", type=int, default=0, help="the servers' port (default: a free one)")
    ap.add_argument("--result-file", type=Path, help="write every figure here as JSON")
    args = ap.parse_args()
    if 1 not in args.concurrency and not args.no_transformers:
        ap.error("transformers runs at concurrency 1: include 1 or pass --no-transformers")
    return args


def main() -> None:
    args = parse_args()
    gguf = fetch_model("smollm2")
    tok = Tokenizer(prepare_model_dir(gguf, Path.home() / ".cache" / "infergate"))
    bias = {str(t): -100 for t in sorted(tok.eos_token_ids)}
    prompts_1k = long_prompts(tok, args.ttft_repeats + 1, args.ttft_tokens)
    servers = ["engine"] + (["llama.cpp"] if args.llama_python else [])
    print(f"SmolLM2-135M-Instruct Q4_1 ({gguf}), {args.tokens} output tokens, greedy, "
          f"{args.threads} threads, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"engine args {args.engine_arg or '(defaults)'}", flush=True)  # fmt: skip
    hf_model = None if args.no_transformers else Transformers(gguf, tok, args.threads)
    rounds: list[dict[str, ServerRun]] = []
    hf: list[float] = []
    for i in range(args.rounds):
        print(f"round {i + 1} (load {os.getloadavg()[0]:.1f})", flush=True)
        rounds.append(run_round(i, servers, gguf, args, bias, prompts_1k))
        if hf_model is not None:
            hf.append(hf_model.tok_s(args.tokens))
            print(f"  transformers: C=1 {hf[-1]:.1f} tok/s", flush=True)
    console = Console(width=200)
    if args.llama_python:
        console.print(tok_s_table(rounds, args.concurrency))
        console.print(ttft_rss_table(rounds))
    if hf:
        console.print(engine_only_table(rounds, hf))
    if args.result_file:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "transformers_tok_s": hf,
                "rounds": [{s: asdict(run) for s, run in r.items()} for r in rounds]}  # fmt: skip
        args.result_file.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
