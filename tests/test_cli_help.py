"""`--help` reads in a normal terminal: at 80 columns and piped, every option's full name.

Rich's option table cut long names to fit (`--served-model-…`); the CLI now uses click's
plain help, which keeps each name whole and wraps only the help text.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from infergate.cli import app


# typer ships its own copy of click: commands and parameters are read by duck typing.
def _commands() -> list[tuple[list[str], Any]]:
    """Every command under ``infergate``, with the words that reach it."""
    out: list[tuple[list[str], Any]] = []

    def walk(path: list[str], command: Any) -> None:
        out.append((path, command))
        for name, sub in getattr(command, "commands", {}).items():
            walk([*path, name], sub)

    walk([], typer.main.get_command(app))
    return out


def _option_names(command: Any) -> list[str]:
    return [
        name
        for param in command.params
        if param.param_type_name == "option" and not param.hidden
        for name in [*param.opts, *param.secondary_opts]
    ]


def _words(text: str) -> set[str]:
    return {word.strip(",") for word in text.split()}


@pytest.mark.parametrize(
    ("path", "command"), _commands(), ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_help_at_80_columns_names_every_option_in_full(path: list[str], command: Any) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    missing = [name for name in _option_names(command) if name not in _words(result.output)]
    assert not missing, f"cut or missing in `{' '.join(path)} --help`: {missing}\n{result.output}"
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_engine_serve_help_piped_from_the_real_entry_point() -> None:
    """The installed entry point, its output piped (not a terminal), COLUMNS=80."""
    result = subprocess.run(
        [sys.executable, "-c", "from infergate.cli import main; main()",
         "engine", "serve", "--help"],
        capture_output=True, text=True, timeout=60, env={"COLUMNS": "80", "PATH": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    words = _words(result.stdout)
    command = typer.main.get_command(app).commands["engine"].commands["serve"]  # type: ignore[attr-defined]
    names = _option_names(command)
    assert "--served-model-name" in names and "--no-enable-prefix-caching" in names
    assert [name for name in names if name not in words] == []


def test_api_key_help_names_every_route_it_guards() -> None:
    """The guard's key check covers /v1/* and KEYED_PATHS; the help says exactly that."""
    from infergate.engine.entrypoints.guard import KEYED_PATHS

    command = typer.main.get_command(app).commands["engine"].commands["serve"]  # type: ignore[attr-defined]
    (api_key,) = [p for p in command.params if "--api-key" in getattr(p, "opts", ())]
    assert "/v1/*" in api_key.help
    for path in KEYED_PATHS:
        assert path in api_key.help
