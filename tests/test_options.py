"""Options declared once (infergate/options.py): the commands are generated from the
dataclass fields, and what a command line says arrives in the dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from infergate.cli import app
from infergate.options import argument, command, inherit, option, options_group


@dataclass
class Inner:
    rate: float = option("--rate", default=1.5, help="A nested option.")


@dataclass
class Toy:
    name: str = argument(help="A positional argument.")
    count: int = option("--count", default=2, min=1, help="How many.")
    tags: list[str] = option("--tag", default_factory=list, help="Repeatable.")
    fast: bool = option("--fast/--slow", default=False, help="A switch.")
    mode: bool = option(
        "--mode", default=False, cli_type=str, cli_default="off", convert=lambda t: t == "on"
    )
    inner: Inner = options_group(Inner)
    internal: int = 7  # no option: not on the command line


@dataclass
class Reuser:
    copies: int = inherit(Toy, "count", "--copies", default=5, help="Copies. {help}")


def _toy_app(cls: type, seen: list[Any]) -> typer.Typer:
    toy = typer.Typer()

    @toy.command()
    @command(cls)
    def run(options: Any) -> None:
        """Toy command."""
        seen.append(options)

    @toy.callback()
    def _root() -> None:
        """Keeps `run` a subcommand."""

    return toy


def test_fields_become_flags_and_flags_fill_the_dataclass() -> None:
    seen: list[Toy] = []
    toy = _toy_app(Toy, seen)
    result = CliRunner().invoke(
        toy, ["run", "x", "--count", "3", "--tag", "a", "--tag", "b", "--fast", "--mode", "on",
              "--rate", "2.5"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert seen == [Toy("x", 3, ["a", "b"], True, True, Inner(2.5))]
    assert CliRunner().invoke(toy, ["run", "y"]).exit_code == 0
    assert seen[1] == Toy("y")  # the command's defaults are the dataclass's
    helped = CliRunner().invoke(toy, ["run", "--help"]).output
    for flag in ("--count", "--tag", "--fast", "--slow", "--mode", "--rate", "How many."):
        assert flag in helped
    assert "internal" not in helped


def test_bad_values_are_usage_errors_naming_the_flag() -> None:
    toy = _toy_app(Toy, [])
    result = CliRunner().invoke(toy, ["run", "x", "--count", "0"])
    assert result.exit_code == 2 and "--count" in result.output


def test_inherit_restates_another_dataclass_option() -> None:
    seen: list[Reuser] = []
    toy = _toy_app(Reuser, seen)
    assert CliRunner().invoke(toy, ["run"]).exit_code == 0
    assert seen == [Reuser(5)]
    helped = CliRunner().invoke(toy, ["run", "--help"]).output
    assert "--copies" in helped and "Copies. How many." in helped
    assert CliRunner().invoke(toy, ["run", "--copies", "0"]).exit_code == 2  # min=1 kept


def test_engine_serve_flags_fill_serve_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import infergate.engine.serve as serve_module
    from infergate.engine.serve import ServeOptions
    from infergate.engine.sim_runner import TimingModel

    seen: list[ServeOptions] = []
    monkeypatch.setattr(serve_module, "serve", seen.append)
    result = CliRunner().invoke(
        app,
        ["engine", "serve", "m", "--simulate", "--served-model-name", "a", "--sim-base-ms", "2",
         "--enable-dev-endpoints", "--lora-modules", "x=/x", "--no-enable-prefix-caching"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (opts,) = seen
    assert opts.model_dir == Path("m") and opts.simulate and opts.served_model_name == ["a"]
    assert opts.timing == TimingModel(base_ms=2.0)
    assert opts.dev_mode and opts.lora_modules == ["x=/x"] and not opts.enable_prefix_caching
    assert opts.port == ServeOptions(Path("m")).port == 8000


def test_up_flags_fill_the_stack_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    import infergate.stack.local as local
    from infergate.stack.local import StackError, StackSpec

    seen: list[StackSpec] = []

    class Captured:
        def __init__(self, spec: StackSpec) -> None:
            seen.append(spec)

        def start(self) -> None:
            raise StackError("not starting in a unit test")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(local, "LocalStack", Captured)
    result = CliRunner().invoke(
        app,
        ["up", "--engines", "3", "--roles", "prefill,decode,decode", "--failure-mode",
         "FailOpen", "--epp-grpc-port", "9100", "--engine-arg=--max-num-seqs=8",
         "--epp-config", "builtin:gie-default", "--max-loras", "3"],
    )  # fmt: skip
    assert result.exit_code == 1 and "not starting" in result.output
    (spec,) = seen
    assert spec.engines == 3 and spec.roles == ["prefill", "decode", "decode"]
    assert spec.failure_mode_allow and spec.epp_grpc_port == 9100
    assert spec.engine_args == ["--max-num-seqs=8"] and spec.max_loras == 3
    assert spec.epp_config_file == Path("builtin:gie-default")
    # `up`'s own defaults: simulated (no --model), TLS to the EPP, FailClose.
    seen.clear()
    CliRunner().invoke(app, ["up"])
    assert seen[0].simulate is True and seen[0].secure_serving is True
    assert seen[0].failure_mode_allow is False
    # A spec built in code keeps its own defaults.
    assert StackSpec().secure_serving is False and StackSpec(model=Path("m")).simulate is False


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["up", "--failure-mode", "Sometimes"], "--failure-mode"),
        (["up", "--response-accounting", "psychic"], "--response-accounting"),
        (["epp", "--endpoint", "nope"], "--endpoint"),
        (["epp", "--endpoint", "127.0.0.1:1", "--metrics-timeout", "soon"], "--metrics-timeout"),
    ],
)
def test_a_bad_value_is_one_usage_error(args: list[str], flag: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert f"Invalid value for '{flag}'" in result.output
