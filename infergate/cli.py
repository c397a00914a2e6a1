"""The single ``infergate`` entry point.

Each component owns its subcommands in its own ``cli`` module; this file only mounts
them. Those modules import nothing heavy at import time, so ``--help`` stays instant.
"""

import typer

from infergate import __version__
from infergate.bench.cli import app as bench_app
from infergate.engine.cli import app as engine_app
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
    rich_markup_mode="markdown",
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
    app()


if __name__ == "__main__":
    main()
