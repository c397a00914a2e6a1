"""One honest exit for subcommands whose capability has not been built yet."""

from typing import NoReturn

import typer


def not_built(capability: str, issue: str) -> NoReturn:
    """Say plainly that a capability is missing and exit non-zero; never pretend."""
    typer.echo(f"infergate: {capability} is not built yet (tracked in {issue}).", err=True)
    raise typer.Exit(code=2)
