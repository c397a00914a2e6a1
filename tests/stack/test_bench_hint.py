"""The ``bench serve`` command ``up`` prints: sized to the engines, and one that parses."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import typer.main

from infergate.bench.cli import app as bench_app
from infergate.stack.cli import bench_hint, engines_on_cpu

BASE = "http://127.0.0.1:8081"


def parse_bench_serve(hint: str) -> dict[str, object]:
    """The hint's arguments as ``bench serve`` parses them (click refuses an unknown flag
    or a bad value), without running the benchmark."""
    argv = shlex.split(hint)
    assert argv[:3] == ["infergate", "bench", "serve"]
    command = typer.main.get_command(bench_app).commands["serve"]  # type: ignore[attr-defined]
    with command.make_context("serve", argv[3:]) as ctx:
        return dict(ctx.params)


def test_simulated_engines_and_gpus_get_the_defaults() -> None:
    hint = bench_hint(BASE, "infergate-tiny", real_on_cpu=False, engines=2)
    params = parse_bench_serve(hint)
    assert params["base_url"] == BASE and params["model"] == "infergate-tiny"
    assert params["dataset"] == "shared-prefix" and params["num_prompts"] == 100


@pytest.mark.parametrize(("engines", "prompts", "rate"), [(1, 8, 0.5), (2, 16, 1.0), (4, 32, 2.0)])
def test_a_real_model_on_cpu_gets_a_small_run_per_engine(
    engines: int, prompts: int, rate: float
) -> None:
    """The defaults (100 requests at once, 1,024-token prefixes) ran 30+ minutes for
    SmolLM2 on CPU; this is ~16× less prefill and decode, arriving over seconds."""
    params = parse_bench_serve(bench_hint(BASE, "smollm2", real_on_cpu=True, engines=engines))
    assert params["num_prompts"] == prompts and params["request_rate"] == rate
    assert params["prefix_len"] == 256 and params["input_len"] == 64
    assert params["output_len"] == 32 and params["num_prefix_groups"] == 2


def test_the_engines_device_comes_from_engine_args_then_the_machine() -> None:
    assert engines_on_cpu(["--device=cpu"]) and engines_on_cpu(
        ["--max-num-seqs", "8", "--device", "cpu"]
    )
    assert not engines_on_cpu(["--device=cuda"]) and not engines_on_cpu(["--device", "cuda"])
    assert engines_on_cpu([]) == (not Path("/dev/nvidiactl").exists())
