"""`infergate engine serve` start-up errors: one line on stderr that says what to do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        ([], "infergate engine make-tiny-model"),
        (["--tensor-parallel-size", "2"], "tensor parallelism is not supported"),
        (["--enable-auto-tool-choice"], "requires --tool-call-parser"),
        (["--tool-call-parser", "mistral"], "unknown parser"),
        (["--generation-config", "/nonexistent-dir"], "generation_config.json"),
        (["--chat-template", "no-such-file.jinja"], "--chat-template"),
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "expected name=path"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
        (["--kv-transfer-config", "{nope"], "--kv-transfer-config is not valid JSON"),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], "not available"),
        (
            ["--kv-transfer-config", '{"kv_connector": "ZmqConnector", "kv_role": "both"}'],
            "kv_role",
        ),
        (["--kv-transfer-bandwidth-gbps", "10"], "needs --kv-transfer-config"),
        (
            [
                "--no-enable-prefix-caching",
                "--kv-transfer-config",
                '{"kv_connector": "ZmqConnector", "kv_role": "kv_consumer"}',
            ],
            "needs prefix caching",
        ),
    ],
)
def test_startup_errors_are_one_clear_line(
    infergate_cli: list[str], tiny_model_dir: Path, tmp_path: Path, extra: list[str], expect: str
) -> None:
    model = tmp_path / "missing" if not extra else tiny_model_dir
    result = subprocess.run(
        [*infergate_cli, "engine", "serve", str(model), "--simulate", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and expect in lines[0]
    assert "Traceback" not in result.stderr


def test_a_real_model_refuses_a_context_past_its_positions(
    infergate_cli: list[str], tiny_model_dir: Path
) -> None:
    """A forward pass cannot run past ``max_position_embeddings``; a simulated engine runs
    none, so only a real one is refused (a replayed trace sets the context it needs)."""
    result = subprocess.run(
        [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--device", "cpu",
         "--max-model-len", "999999"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "max_position_embeddings" in lines[0]
    assert "Traceback" not in result.stderr


def test_startup_refuses_an_adapter_above_max_lora_rank(
    infergate_cli: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from infergate.engine.lora.tiny import make_tiny_lora

    wide = make_tiny_lora(tiny_model_dir, tmp_path / "wide", rank=16)
    result = subprocess.run(
        [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--device", "cpu",
         "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"wide={wide}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "rank 16" in lines[0] and "--max-lora-rank 8" in lines[0]


def test_make_tiny_model_writes_peft_adapters(infergate_cli: list[str], tmp_path: Path) -> None:
    result = subprocess.run(
        [*infergate_cli, "engine", "make-tiny-model", str(tmp_path / "m"), "--lora-adapters", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for i in range(2):
        adapter = tmp_path / "m" / "loras" / f"lora-{i}"
        assert (adapter / "adapter_config.json").is_file()
        assert (adapter / "adapter_model.safetensors").is_file()
