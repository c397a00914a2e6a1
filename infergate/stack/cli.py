"""``infergate up``: the whole stack on one machine."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, BinaryIO

import typer

from infergate.options import command
from infergate.stack.local import StackSpec

if TYPE_CHECKING:
    from rich.console import Console

    from infergate.stack.local import LocalStack

_CURL = """curl -sN {base}/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{{"model": "{model}", "stream": true, "max_tokens": 32,
       "messages": [{{"role": "user", "content": "Hello!"}}]}}'"""

_OPENAI = """from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="{model}", max_tokens=32, stream=True,
    messages=[{{"role": "user", "content": "Hello!"}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)"""

#: ``bench serve`` arguments for a real model on CPU. The defaults (100 requests at once,
#: 1,024-token prefixes) suit simulated engines and a GPU, and ran over half an hour for
#: SmolLM2-135M on CPU; on CPU the prompts and output length come from :func:`cpu_bench_size`.
CPU_BENCH = (
    "--num-prompts {prompts} --request-rate {rate:g} --num-prefix-groups 2 "
    "--prefix-len 256 --input-len 64 --output-len {output_len}"
)

#: What one CPU core gets through, in parameters x output tokens a second, for requests
#: shaped as CPU_BENCH (prefill, HTTP, Envoy and the EPP included): two SmolLM2-135M
#: engines served 16 requests of 32 tokens in 28 s on 2 cores at load 4-8, 3.5 core-seconds
#: a request (docs/local-stack.md). Larger models cost proportionally more.
CPU_PARAM_TOKENS_PER_CORE_S = 1.2e9
#: The run the hint sizes for, at that pace; a machine twice as loaded still ends in 2 minutes.
CPU_BENCH_BUDGET_S = 45.0


@dataclass(frozen=True)
class CpuBenchSize:
    """How much work the CPU hint asks for."""

    prompts: int
    rate: float
    output_len: int


def cpu_bench_size(params: int, cpus: int, engines: int) -> CpuBenchSize:
    """Prompts and output length that a model of `params` parameters on `engines` engines
    gets through in about CPU_BENCH_BUDGET_S on `cpus` cores: each engine computes on its
    own core at most (a small model's engine runs one torch thread). Outputs shrink from
    32 to 8 tokens before the prompts fall under two per engine; at least one prompt per
    engine, at most the defaults' 100. Arrivals spread over the budget's first half."""
    if params <= 0 or cpus <= 0 or engines <= 0:
        raise ValueError(f"params, cpus and engines must be positive: {params}, {cpus}, {engines}")
    core_seconds = CPU_BENCH_BUDGET_S * min(cpus, engines)
    for output_len in (32, 16, 8):
        prompts = int(core_seconds * CPU_PARAM_TOKENS_PER_CORE_S / (params * output_len))
        if prompts >= 2 * engines:
            break
    prompts = max(engines, min(100, prompts))
    return CpuBenchSize(prompts, round(prompts / (CPU_BENCH_BUDGET_S / 2), 1) or 0.1, output_len)


def bench_hint(
    base_url: str, model: str, *, engines: int, cpu_params: int | None, cpus: int = 1
) -> str:
    """The ``bench serve`` command ``up`` suggests: the defaults for simulated engines or a
    GPU (`cpu_params` None), work sized to the model and the machine for a real model of
    `cpu_params` parameters on `cpus` CPU cores, so that it ends in about a minute."""
    hint = f"infergate bench serve --base-url {base_url} --model {model} --dataset shared-prefix"
    if cpu_params is not None:
        size = cpu_bench_size(cpu_params, cpus, engines)
        hint += " " + CPU_BENCH.format(
            prompts=size.prompts, rate=size.rate, output_len=size.output_len
        )
    return hint


def model_params(model: Path) -> int:
    """Parameters of a model from its weight files' headers (a .gguf, or a directory of
    safetensors or holding a .gguf), without loading a weight or importing torch."""
    if model.is_dir():
        files = sorted(model.glob("*.safetensors"))
        if files:
            return sum(_safetensors_params(f) for f in files)
        ggufs = sorted(model.glob("*.gguf"))
        if not ggufs:
            raise ValueError(f"{model} holds no .safetensors or .gguf file")
        model = ggufs[0]
    return _gguf_params(model)


def _safetensors_params(path: Path) -> int:
    """The elements of every tensor in a safetensors file's JSON header."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


#: GGUF's fixed-size value types (type id -> bytes); 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_params(path: Path) -> int:
    """The elements of every tensor a GGUF file (v2/v3) lists after its metadata."""
    with path.open("rb") as f:
        magic, _version, tensors, kvs = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        for _ in range(kvs):
            f.seek(struct.unpack("<Q", f.read(8))[0], 1)  # the key
            _gguf_skip(f, struct.unpack("<I", f.read(4))[0])
        total = 0
        for _ in range(tensors):
            f.seek(struct.unpack("<Q", f.read(8))[0], 1)  # the name
            (dims,) = struct.unpack("<I", f.read(4))
            total += math.prod(struct.unpack(f"<{dims}Q", f.read(8 * dims)))
            f.seek(12, 1)  # type, offset
    return total


def _gguf_skip(f: BinaryIO, kind: int) -> None:
    """Past one metadata value of type `kind`."""
    if kind in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[kind], 1)
    elif kind == 8:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _gguf_skip(f, item)
    else:
        raise ValueError(f"unknown GGUF metadata type {kind}")


def engines_on_cpu(engine_args: Sequence[str]) -> bool:
    """Whether real engines run on CPU: ``--device cpu`` among ``--engine-arg``, or (their
    ``--device auto``) no NVIDIA driver on this machine. Read without importing torch,
    which would cost ``up`` seconds to print a hint."""
    args = list(engine_args)
    for i, arg in enumerate(args):
        if arg.startswith("--device="):
            return arg.partition("=")[2] == "cpu"
        if arg == "--device" and i + 1 < len(args):
            return args[i + 1] == "cpu"
    return not Path("/dev/nvidiactl").exists()


class _Stop(Exception):
    """Raised from the SIGINT/SIGTERM handler: every stop takes the same path."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


@command(StackSpec)
def up(spec: StackSpec) -> None:
    """Run N engines, one Endpoint Picker and one real Envoy on loopback; Ctrl-C stops all.

    The EPP discovers the engines from an endpoints file it hot-reloads; edit it (see
    --workdir) to add or remove engines while the stack runs.
    """
    from rich.console import Console
    from rich.text import Text

    from infergate.stack.local import LocalStack, StackError

    console = Console()
    stack = LocalStack(spec)
    # Installed explicitly: a shell starting us in the background leaves SIGINT ignored.
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with console.status(
            f"starting {spec.engines} engine(s), the EPP and Envoy…", spinner="dots"
        ):
            stack.start()
        _print_ready(console, stack)
        _watch(stack)
    except StackError as error:
        console.print(Text(f"infergate up: {error}", style="red"))
        raise typer.Exit(1) from None
    except (KeyboardInterrupt, _Stop):  # KeyboardInterrupt: Ctrl-C before our handler
        console.print("\ninfergate up: stopping…")
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    console.print("infergate up: stopped")


def _print_ready(console: Console, stack: LocalStack) -> None:
    """The components table, where the files are, and how to send a first request."""
    from rich.table import Table

    table = Table(title="infergate up", title_justify="left")
    for column in ("component", "where", "pid", "log"):
        table.add_column(column, overflow="fold")
    for name, where, process in stack.components():
        log = process.log_path.name if process and process.log_path else "-"
        table.add_row(name, where, str(process.pid) if process else "-", log)
    console.print(table)
    kept = "kept" if stack.spec.workdir else "removed on exit; keep them with --workdir"
    console.print(f"logs, endpoints.yaml, envoy.yaml: {stack.workdir} ({kept})", soft_wrap=True)
    example = {"base": stack.base_url, "model": stack.model_name}
    console.print("\n[bold]Send a request:[/bold]")
    console.print(_CURL.format(**example), markup=False, highlight=False, soft_wrap=True)
    console.print("\n[bold]Or with the openai client:[/bold]")
    console.print(_OPENAI.format(**example), markup=False, highlight=False, soft_wrap=True)
    on_cpu = not stack.spec.simulate and engines_on_cpu(stack.spec.engine_args)
    hint = bench_hint(
        stack.base_url,
        stack.model_name,
        engines=stack.spec.engines,
        cpu_params=model_params(stack.model_dir) if on_cpu and stack.model_dir else None,
        cpus=len(os.sched_getaffinity(0)),
    )
    console.print(f"\n[bold]Benchmark it:[/bold] {hint}", highlight=False, soft_wrap=True)
    console.print(f"\ninfergate up: ready on {stack.base_url} (Ctrl-C stops everything)")


def _watch(stack: LocalStack) -> None:
    """Block until Envoy dies (then fail loudly) or the user stops us; a dead engine or
    EPP replica, a lone EPP included, is reported and restarted
    (:mod:`infergate.stack.supervise`)."""
    from rich.console import Console
    from rich.text import Text

    from infergate.stack.local import StackError
    from infergate.stack.supervise import EngineSupervisor, EppSupervisor

    console = Console(stderr=True)

    def say(text: str) -> None:
        console.print(Text(text, style="yellow"))

    engines, epps = EngineSupervisor(stack, say), EppSupervisor(stack, say)
    while True:
        time.sleep(0.5)
        engines.check()
        epps.check()
        for name, _, process in stack.components():
            if name.startswith(("engine-", "epp")):
                continue
            if process is not None and not process.alive():
                code = process.popen.returncode if process.popen else None
                raise StackError(
                    f"{name} exited unexpectedly (code {code}); stopping the stack.\n"
                    f"--- last lines of {process.log_path} ---\n{process.log_tail()}"
                )
