"""The single ``infergate`` entry point.

Each component owns its subcommands in its own ``cli`` module; this file only mounts
them. Those modules import nothing heavy at import time, so ``--help`` stays instant.
"""

import sys

import typer

from infergate import __version__
from infergate.bench.cli import app as bench_app
from infergate.engine.cli import app as engine_app
from infergate.envoy.drain import envoy_drain
from infergate.epp.cli import epp
from infergate.operator.cli import operator
from infergate.stack.cli import up

app = typer.Typer(
    name="infergate",
    help=(
        "infergate: an inference-aware gateway for Kubernetes.\n\n"
        "Start with `infergate up` for the whole stack on this machine (engines, an "
        "Endpoint Picker and Envoy), then send OpenAI requests to http://127.0.0.1:8081."
    ),
    no_args_is_help=True,
    add_completion=False,
    # click's plain help: rich's option table cuts long option names to fit 80 columns
    # (`--served-model-…`), and a help text must read the same piped as on a terminal.
    rich_markup_mode=None,
)
app.add_typer(engine_app, name="engine")
app.add_typer(bench_app, name="bench")
app.command(
    "epp",
    context_settings={"help_option_names": ["-h", "--help"]},
)(epp)
app.command(
    "operator",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)(operator)
app.command("up")(up)
app.command("envoy-drain")(envoy_drain)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"infergate {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """infergate: an inference-aware gateway for Kubernetes."""


def main() -> None:
    argv = sys.argv[1:]
    if argv[:2] == ["engine", "serve"] and not {"-h", "--help"} & set(argv):
        argv = argv[:2] + _vllm_serve_args(argv[2:])
    if argv[:1] == ["epp"] and not {"-h", "--help"} & set(argv):
        from infergate.epp.cli import gie_args

        argv = argv[:1] + gie_args(argv[1:])
    app(args=argv)


def _vllm_serve_args(args: list[str]) -> list[str]:
    """``vllm serve``'s spellings (--model, prefixes, flags with no meaning here) rewritten
    for ``engine serve`` (engine/vllm_args.py)."""
    from infergate.engine.vllm_args import VllmArgsError, normalize, serve_options

    try:
        rewritten, notes = normalize(args, serve_options())
    except VllmArgsError as error:
        typer.echo(f"infergate engine serve: {error}", err=True)
        raise SystemExit(2) from None
    for note in notes:
        typer.echo(f"infergate engine serve: {note}", err=True)
    return rewritten


if __name__ == "__main__":
    main()
