"""The ``bench serve`` command ``up`` prints: sized to the model, the machine and the
engines, and one that parses."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer.main

from infergate.bench.cli import app as bench_app
from infergate.stack.cli import (
    CPU_BENCH_BUDGET_S,
    CPU_PARAM_TOKENS_PER_CORE_S,
    bench_hint,
    cpu_bench_size,
    engines_on_cpu,
    model_params,
)

BASE = "http://127.0.0.1:8081"


def parse_bench_serve(hint: str) -> dict[str, Any]:
    """The hint's arguments as ``bench serve`` parses them (click refuses an unknown flag
    or a bad value), without running the benchmark."""
    argv = shlex.split(hint)
    assert argv[:3] == ["infergate", "bench", "serve"]
    command = typer.main.get_command(bench_app).commands["serve"]  # type: ignore[attr-defined]
    with command.make_context("serve", argv[3:]) as ctx:
        return dict(ctx.params)


def test_simulated_engines_and_gpus_get_the_defaults() -> None:
    hint = bench_hint(BASE, "infergate-tiny", engines=2, cpu_params=None)
    params = parse_bench_serve(hint)
    assert params["base_url"] == BASE and params["model"] == "infergate-tiny"
    assert params["dataset"] == "shared-prefix" and params["num_prompts"] == 100


SMOLLM2_PARAMS = 134_515_008  # SmolLM2-135M-Instruct's GGUF


def estimated_seconds(params: int, cpus: int, engines: int) -> float:
    """The run's length by the sizing's own pace (parameters x output tokens per core-s)."""
    size = cpu_bench_size(params, cpus, engines)
    work = size.prompts * params * size.output_len / CPU_PARAM_TOKENS_PER_CORE_S
    return work / min(cpus, engines)


def test_a_real_model_on_cpu_gets_a_run_of_under_a_minute_at_the_calibrated_pace() -> None:
    """The defaults (100 requests at once, 1,024-token prefixes) ran 30+ minutes for
    SmolLM2 on CPU; on the 2-core machine the hint now asks for about 45 s of work."""
    for engines in (1, 2, 4):
        assert estimated_seconds(SMOLLM2_PARAMS, 2, engines) <= CPU_BENCH_BUDGET_S
    hint = bench_hint(BASE, "smollm2", engines=2, cpu_params=SMOLLM2_PARAMS, cpus=2)
    params = parse_bench_serve(hint)
    assert 2 * 2 <= params["num_prompts"] < 100 and params["output_len"] == 32
    assert params["prefix_len"] == 256 and params["input_len"] == 64
    assert params["num_prefix_groups"] == 2 and params["request_rate"] > 0


def test_the_size_follows_the_model_and_the_machine() -> None:
    two_cores = cpu_bench_size(SMOLLM2_PARAMS, 2, 2)
    assert cpu_bench_size(SMOLLM2_PARAMS, 1, 2).prompts < two_cores.prompts  # fewer cores
    assert cpu_bench_size(SMOLLM2_PARAMS, 2, 1).prompts < two_cores.prompts  # one engine
    bigger = cpu_bench_size(10 * SMOLLM2_PARAMS, 2, 2)
    assert bigger.prompts < two_cores.prompts
    huge = cpu_bench_size(7_000_000_000, 2, 2)  # outputs shrink, one prompt per engine stays
    assert huge.output_len == 8 and huge.prompts == 2
    assert cpu_bench_size(130_240, 2, 2).prompts == 100  # the tiny model: the defaults' count
    with pytest.raises(ValueError, match="positive"):
        cpu_bench_size(0, 2, 2)


def write_gguf(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A GGUF v3 file with string, array and scalar metadata and float32 tensors."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", "sized")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_uint32("llama.context_length", 64)
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_model_params_read_from_the_weight_files_headers(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", {"a": (3, 4), "b": (5,), "c": (2, 3, 7)})
    assert model_params(tmp_path / "m.gguf") == 12 + 5 + 42
    assert model_params(tmp_path) == 59  # a directory holding a .gguf
    from safetensors.numpy import save_file

    st = tmp_path / "st"
    st.mkdir()
    save_file({"w": np.zeros((4, 6), dtype=np.float16)}, str(st / "model-1.safetensors"))
    save_file({"v": np.zeros((10,), dtype=np.float32)}, str(st / "model-2.safetensors"))
    assert model_params(st) == 34
    with pytest.raises(ValueError, match="not a GGUF"):
        model_params(st / "model-1.safetensors")


def test_the_engines_device_comes_from_engine_args_then_the_machine() -> None:
    assert engines_on_cpu(["--device=cpu"]) and engines_on_cpu(
        ["--max-num-seqs", "8", "--device", "cpu"]
    )
    assert not engines_on_cpu(["--device=cuda"]) and not engines_on_cpu(["--device", "cuda"])
    assert engines_on_cpu([]) == (not Path("/dev/nvidiactl").exists())
