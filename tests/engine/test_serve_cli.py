"""`infergate engine serve` start-up errors: one line on stderr that says what to do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        ([], "infergate engine make-tiny-model"),
        (["--max-model-len", "999999"], "max_position_embeddings"),
        (["--tensor-parallel-size", "2"], "tensor parallelism is not supported"),
        (["--enable-auto-tool-choice"], "tool calling is not implemented"),
        (["--tool-call-parser", "hermes"], "tool calling is not implemented"),
        (["--generation-config", "/nonexistent-dir"], "generation_config.json"),
        (["--chat-template", "no-such-file.jinja"], "--chat-template"),
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
