"""Engine-side priority under saturation: TTFT per class, fcfs against priority.

One ``infergate engine serve --simulate`` process per policy (the same flags otherwise),
driven the same way in the same run: ``--background`` closed-loop clients keep far more
requests in the engine than ``--max-num-seqs`` lets run (the waiting queue never
empties), while an "important" class arrives every ``--interval`` seconds carrying
``x-infergate-priority: -1`` — what the EPP sends for an InferenceObjective of priority 1.
Under fcfs the engine ignores that header, so the important class queues behind the
background; under ``--scheduling-policy priority`` it is admitted at the next free slot.
TTFT is measured at the client (first streamed token); the first ``--warmup`` seconds are
not counted. Prints (never asserts) p50 / p90 per class and policy, and the ratio.

``--gateway`` runs the same load through real Envoy and the EPP (``infergate``'s local
stack, one engine, no flow control): the important class then names an InferenceObjective
of priority 1 (``x-gateway-inference-objective``) and the EPP sets the engine header.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from infergate.procs import ProcessGroup, free_port, http_ready
from infergate.stack.local import LocalStack, StackSpec
from infergate.wire.names import PRIORITY_HEADER

OBJECTIVE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: important}
spec: {priority: 1, poolRef: {name: local}}
"""


def start_engine(group: ProcessGroup, model_dir: Path, policy: str, max_num_seqs: int) -> str:
    port = free_port()
    exe = Path(sys.executable).parent / "infergate"
    group.start(
        f"engine-{policy}",
        [str(exe), "engine", "serve", str(model_dir), "--simulate", "--port", str(port),
         "--served-model-name", "sim", "--log-level", "warning", "--max-model-len", "4096",
         "--max-num-seqs", str(max_num_seqs), "--scheduling-policy", policy],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    return f"http://127.0.0.1:{port}"


async def ttft(
    client: httpx.AsyncClient, body: dict[str, object], headers: dict[str, str]
) -> float:
    """Seconds to the first streamed token (the stream is then read to its end)."""
    start = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as res:
        res.raise_for_status()
        async for line in res.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def start_stack(model_dir: Path, policy: str, args: argparse.Namespace, work: Path) -> LocalStack:
    """Envoy + EPP + one simulated engine (the caller enters and leaves it)."""
    work.mkdir(parents=True)
    (work / "objectives.yaml").write_text(OBJECTIVE)
    spec = StackSpec.on_free_ports(
        engines=1,
        model=model_dir,
        served_model_name="sim",
        simulate=True,
        objectives_file=work / "objectives.yaml",
        engine_args=[
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-model-len",
            "4096",
            "--scheduling-policy",
            policy,
        ],
        access_log=False,
        workdir=work,
        start_timeout=180.0,
    )
    return LocalStack(spec)


async def run_load(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Background clients + the periodic important class; TTFTs after the warm-up."""
    words = " word" * args.prompt_tokens
    results: dict[str, list[float]] = {"important": [], "background": []}
    important_headers = (
        {"x-gateway-inference-objective": "important"} if args.gateway else {PRIORITY_HEADER: "-1"}
    )
    begin = time.monotonic()
    stop = begin + args.warmup + args.duration

    def keep(kind: str, value: float, started: float) -> None:
        if started >= begin + args.warmup:
            results[kind].append(value)

    async def background(client: httpx.AsyncClient, k: int) -> None:
        i = 0
        while time.monotonic() < stop:
            body = {"model": "sim", "prompt": f"bg {k} {i}{words}", "stream": True,
                    "max_tokens": args.background_tokens}  # fmt: skip
            started = time.monotonic()
            keep("background", await ttft(client, body, {}), started)
            i += 1

    async def important(client: httpx.AsyncClient) -> None:
        tasks = []
        i = 0
        while time.monotonic() < stop:
            body = {"model": "sim", "prompt": f"vip {i}{words}", "stream": True,
                    "max_tokens": args.important_tokens}  # fmt: skip

            async def one(body: dict[str, object] = body) -> None:
                started = time.monotonic()
                keep("important", await ttft(client, body, important_headers), started)

            tasks.append(asyncio.create_task(one()))
            i += 1
            await asyncio.sleep(args.interval)
        await asyncio.gather(*tasks)

    limits = httpx.Limits(max_connections=args.background + 64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await asyncio.gather(
            important(client), *(background(client, k) for k in range(args.background))
        )
    return results


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model dir (default: a fresh tiny model)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--background", type=int, default=16, help="closed-loop background clients")
    ap.add_argument("--background-tokens", type=int, default=64)
    ap.add_argument("--important-tokens", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--interval", type=float, default=0.25, help="s between important requests")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per policy")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--gateway", action="store_true", help="through Envoy + the EPP")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from infergate.engine.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0)
        table: dict[str, dict[str, list[float]]] = {}
        for policy in ("fcfs", "priority"):
            if args.gateway:
                with start_stack(model_dir, policy, args, Path(tmp) / policy) as stack:
                    table[policy] = asyncio.run(run_load(stack.base_url, args))
                continue
            with ProcessGroup() as group:
                url = start_engine(group, model_dir, policy, args.max_num_seqs)
                table[policy] = asyncio.run(run_load(url, args))

    how = "through Envoy + EPP, objective priority 1" if args.gateway else "direct"
    print(f"== engine-side priority ({how}): simulated engine, --max-num-seqs {args.max_num_seqs}, "
          f"{args.background} background clients ({args.background_tokens} tokens out), "
          f"important class every {args.interval:g} s ({args.important_tokens} tokens out, "
          f"engine priority -1), prompts ~{args.prompt_tokens} tokens, "
          f"{args.duration:g} s measured per policy")  # fmt: skip
    print(f"{'policy':<9} {'class':<11} {'n':>5} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12}")
    for policy, classes in table.items():
        for kind, values in classes.items():
            print(f"{policy:<9} {kind:<11} {len(values):>5} {pct(values, 50):>12.1f} "
                  f"{pct(values, 90):>12.1f}")  # fmt: skip
        ratio = pct(classes["background"], 50) / pct(classes["important"], 50)
        print(f"{policy:<9} background p50 / important p50 = {ratio:.1f}x")


if __name__ == "__main__":
    main()
