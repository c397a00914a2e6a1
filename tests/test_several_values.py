"""vLLM's multi-value flags (argparse's ``nargs='+'``): ``--served-model-name a b`` and
``--goodput ttft:200 tpot:50`` parse as the repeated flag does (infergate.options'
``several`` options and the :class:`SeveralValues` command that parses them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer.main
from infergate.engine.serve import ServeOptions
from typer.testing import CliRunner

from infergate.bench.options import BenchServeOptions
from infergate.cli import app
from infergate.options import SeveralValues, build


def parse(path: list[str], args: list[str]) -> dict[str, Any]:
    """``args`` as the command at ``path`` parses them, without running it."""
    command: Any = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    with command.make_context(path[-1], list(args)) as ctx:
        return dict(ctx.params)


def engine_serve(*args: str) -> ServeOptions:
    return build(ServeOptions, parse(["engine", "serve"], list(args)))


def bench_serve(*args: str) -> BenchServeOptions:
    params = parse(["bench", "serve"], ["--base-url", "http://127.0.0.1:9", *args])
    return build(BenchServeOptions, params)


def test_served_model_name_takes_several_names_after_one_flag() -> None:
    opts = engine_serve("m", "--served-model-name", "a", "b", "--simulate")
    assert opts.model_dir == Path("m") and opts.simulate
    assert opts.served_model_name == ["a", "b"]
    # Repeating the flag, and a value with its own '=', still work.
    assert engine_serve(
        "m", "--served-model-name", "a", "--served-model-name=b"
    ).served_model_name == [
        "a",
        "b",
    ]


def test_the_model_dir_after_a_run_of_names_is_the_model_dir() -> None:
    """argparse would take MODEL_DIR as a name too; the run gives its last value back to
    the missing argument, so the command lines that worked before still do."""
    opts = engine_serve("--served-model-name", "a", "m")
    assert opts.model_dir == Path("m") and opts.served_model_name == ["a"]
    opts = engine_serve("--served-model-name", "a", "b", "m", "--port", "9")
    assert opts.model_dir == Path("m") and opts.served_model_name == ["a", "b"] and opts.port == 9


def test_lora_modules_take_several_adapters_after_one_flag() -> None:
    opts = engine_serve(
        "m", "--lora-modules", "x=/x", '{"name": "y", "path": "/y"}', "--enable-lora"
    )
    assert opts.lora_modules == ["x=/x", '{"name": "y", "path": "/y"}'] and opts.enable_lora


def test_goodput_takes_several_slos_after_one_flag() -> None:
    """docs/local-stack.md's own example."""
    opts = bench_serve("--goodput", "ttft:200", "tpot:50", "--num-prompts", "3")
    assert opts.goodput == {"ttft": 200.0, "tpot": 50.0} and opts.num_prompts == 3
    assert bench_serve("--goodput", "ttft:200 tpot:50").goodput == {"ttft": 200.0, "tpot": 50.0}
    assert bench_serve().goodput is None


def test_a_several_flag_without_a_value_is_a_usage_error() -> None:
    result = CliRunner().invoke(
        app, ["bench", "serve", "--base-url", "x", "--goodput", "--seed", "1"]
    )
    assert result.exit_code == 2 and "'--goodput': needs at least one value" in result.output
    with pytest.raises(typer.BadParameter, match="expected NAME:MS"):
        bench_serve("--goodput", "ttft:200", "tpot")


def test_every_command_with_several_values_parses_them() -> None:
    """A ``several`` option in a command registered without ``cls=SeveralValues`` would
    take one value per flag and refuse the rest."""

    def commands(group: Any) -> list[Any]:
        out = []
        for command in group.commands.values():
            out += commands(command) if hasattr(command, "commands") else [command]
        return out

    found = [
        c for c in commands(typer.main.get_command(app)) if getattr(c.callback, "several", None)
    ]
    assert {c.name for c in found} >= {"serve"} and len(found) >= 2
    for command in found:
        assert isinstance(command, SeveralValues), command.name
