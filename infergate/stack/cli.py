"""``infergate up``: the whole stack on one machine."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

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

#: ``bench serve`` arguments for a real model on CPU, per engine 8 requests at 0.5 req/s:
#: 28 s for SmolLM2-135M on two engines sharing two busy cores (docs/local-stack.md). The
#: defaults (100 requests at once, 1,024-token prefixes) suit simulated engines and a GPU,
#: and take over half an hour on CPU.
CPU_BENCH = (
    "--num-prompts {prompts} --request-rate {rate:g} --num-prefix-groups 2 "
    "--prefix-len 256 --input-len 64 --output-len 32"
)


def bench_hint(base_url: str, model: str, *, real_on_cpu: bool, engines: int) -> str:
    """The ``bench serve`` command ``up`` suggests, sized so it ends in about a minute:
    the defaults for simulated engines or a GPU, far less work for a real model on CPU."""
    hint = f"infergate bench serve --base-url {base_url} --model {model} --dataset shared-prefix"
    if real_on_cpu:
        hint += " " + CPU_BENCH.format(prompts=8 * engines, rate=0.5 * engines)
    return hint


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
    hint = bench_hint(
        stack.base_url,
        stack.model_name,
        real_on_cpu=not stack.spec.simulate and engines_on_cpu(stack.spec.engine_args),
        engines=stack.spec.engines,
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
