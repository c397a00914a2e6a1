"""Command lines written from options (infergate/options.py's ``to_argv``): what a caller
builds in code is what the started process parses, for every flag of ``infergate epp``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import typer
from infergate.epp.cli import gie_args
from infergate.epp.options import EppOptions
from infergate.epp.types import Endpoint

from infergate.options import argument, cli_fields, command, option, options_group, to_argv

T = TypeVar("T")


def parse(cls: type[T], args: list[str]) -> T:
    """``args`` through the parser :func:`command` generates for ``cls`` (the one each
    command of ours runs), returning the options it builds."""
    app = typer.Typer()
    app.command()(command(cls)(lambda options: options))
    result: T = typer.main.get_command(app).main(args=args, standalone_mode=False)
    return result


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Inner:
    rate: float = option("--rate", default=1.5)


@dataclass
class Toy:
    name: str = argument(help="A positional argument.")
    count: int = option("--count", default=2)
    tags: list[str] = option("--tag", default_factory=list)
    fast: bool = option("--fast/--slow", default=True)
    debug: bool = option("--debug", default=False)
    color: Color = option("--color", default=Color.RED)
    scaled: float = option(
        "--scaled-ms", default=1.0, cli_type=str, cli_default="1000",
        convert=lambda t: float(t) / 1000, render=lambda v: str(v * 1000),
    )  # fmt: skip
    inner: Inner = options_group(Inner)
    internal: int = 7


def test_defaults_write_only_the_arguments() -> None:
    assert to_argv(Toy("n")) == ["n"]
    assert parse(Toy, ["n"]) == Toy("n")


def test_every_kind_of_value_round_trips() -> None:
    toy = Toy("n", 3, ["a", "b"], False, True, Color.BLUE, 0.25, Inner(rate=2.5))
    argv = to_argv(toy)
    assert argv == [
        "n", "--count", "3", "--tag", "a", "--tag", "b", "--slow", "--debug",
        "--color", "blue", "--scaled-ms", "250.0", "--rate", "2.5",
    ]  # fmt: skip
    assert parse(Toy, argv) == toy


def test_always_writes_a_default_and_bad_values_are_named() -> None:
    assert to_argv(Toy("n"), always=("count", "fast")) == ["n", "--count", "2", "--fast"]
    with pytest.raises(ValueError, match=r"Toy\.internal has no command-line flag"):
        to_argv(Toy("n", internal=8))
    with pytest.raises(ValueError, match="--debug has no form that sets it false"):
        to_argv(Toy("n"), always=("debug",))


#: A value other than the default for every flag of ``infergate epp``.
EPP_VALUES: dict[str, Any] = {
    "pool_name": "pool-a",
    "pool_namespace": "ns-b",
    "endpoints_file": Path("/etc/endpoints.yaml"),
    "static_endpoints": [Endpoint("10.0.0.7", 8000), Endpoint("fd00::7", 8001)],
    "config_file": Path("/etc/config.yaml"),
    "config_text": "apiVersion: x\nkind: EndpointPickerConfig\n",
    "client_priority_max": 3,
    "objectives_file": Path("/etc/objectives.yaml"),
    "host": "127.0.0.9",
    "grpc_port": 19002,
    "grpc_health_port": 19003,
    "metrics_port": 19090,
    "refresh_metrics_interval": 0.125,
    "metrics_staleness_threshold": 3.5,
    "metrics_timeout": 0.75,
    "max_request_body_bytes": 12345,
    "max_buffered_bytes": 67890,
    "max_streams": 42,
    "body_timeout_s": None,
    "completion_events_port": 5601,
    "scores_header": True,
    "secure_serving": True,
    "cert_path": Path("/etc/tls"),
    "client_ca_file": Path("/etc/tls/ca.crt"),
    "log_level": "debug",
    "workers": 3,
    "grpc_server": "aio",
    "shutdown_delay_s": 4.0,
    "shutdown_grace_s": 45.0,
    "reuse_port": True,
}


def test_every_epp_flag_round_trips_through_the_epp_parser() -> None:
    """options → argv → ``infergate epp``'s parser (after its GIE-flag rewriting) → the
    same options. A new flag without a value above fails here, so it gets one."""
    assert set(EPP_VALUES) == {f.name for f, _ in cli_fields(EppOptions)}
    options = EppOptions(**EPP_VALUES)
    argv = options.argv()
    assert argv[0] == "epp"
    assert gie_args(argv[1:]) == argv[1:]
    assert parse(EppOptions, argv[1:]) == options


def test_epp_defaults_and_what_no_flag_carries() -> None:
    assert EppOptions().argv() == ["epp"]
    assert EppOptions(body_timeout_s=5.0).argv() == ["epp", "--body-timeout", "5.0"]
    assert parse(EppOptions, ["--body-timeout", "0"]).body_timeout_s is None
    always = EppOptions().argv(always=("grpc_port", "secure_serving"))
    assert always == ["epp", "--grpc-port", "9002", "--no-secure-serving"]
    with pytest.raises(ValueError, match="cannot carry labels"):
        EppOptions(static_endpoints=[Endpoint("10.0.0.7", 8000, (("a", "b"),))]).argv()
    with pytest.raises(ValueError, match=r"EppOptions\.config has no command-line flag"):
        EppOptions(config=cast(Any, object())).argv()
