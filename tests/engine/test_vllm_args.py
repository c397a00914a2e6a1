"""`engine serve` takes `vllm serve`'s spellings as manifests write them: `--model`, unique
prefixes, several `--lora-modules` values after one flag, and flags with no meaning here."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from infergate.engine.vllm_args import VllmArgsError, normalize, serve_options

from infergate.procs import free_port


def test_vllm_spellings_become_engine_serve_flags() -> None:
    options = serve_options()
    assert options["--max-num-seqs"] and not options["--simulate"]  # read from the command
    args, notes = normalize(
        ["--model", "/m", "--max-num-seq", "4", "--lora-modules", "a=/a", '{"name": "b"}',
         "--enforce-eager", "--compilation-config", '{"cudagraph_mode": "NONE"}',
         "--uvicorn-log-level=debug", "--kv-cache-dtype", "auto", "--port=9"],
        options,
    )  # fmt: skip
    # Several values after one flag stay: the command parses them (tests/test_several_values.py).
    assert args == [
        "/m", "--max-num-seqs", "4", "--lora-modules", "a=/a", '{"name": "b"}',
        "--log-level=debug", "--kv-cache-dtype", "auto", "--port=9",
    ]  # fmt: skip
    assert [n.split()[0] for n in notes] == ["--enforce-eager", "--compilation-config"]
    # An ambiguous prefix stays as given, so the command names it in its error.
    assert normalize(["--max-num"], options)[0] == ["--max-num"]
    with pytest.raises(VllmArgsError, match="--model needs a value"):
        normalize(["--model"], options)


def test_a_manifest_style_command_line_serves(
    infergate_cli: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from infergate.engine.lora.tiny import make_tiny_lora

    a = make_tiny_lora(tiny_model_dir, tmp_path / "a", rank=8)
    b = make_tiny_lora(tiny_model_dir, tmp_path / "b", rank=8)
    port = free_port()
    argv = [
        *infergate_cli, "engine", "serve", "--model", str(tiny_model_dir), "--simulate",
        "--served-model-name", "tiny", "tiny-alias", "--port", str(port), "--max-num-seq", "4", "--enforce-eager",
        "--compilation-config", '{"cudagraph_mode": "NONE"}', "--enable-chunked-prefill",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
        "--enable-lora", "--max-loras", "2", "--lora-modules", f"food-a={a}",
        json.dumps({"name": "food-b", "path": str(b)}),
    ]  # fmt: skip
    log = (tmp_path / "engine.log").open("w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "engine.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert {"tiny", "tiny-alias", "food-a", "food-b"} <= {m["id"] for m in models["data"]}
        out = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "food-b", "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )
        assert out.status_code == 200, out.text
    finally:
        process.terminate()
        process.wait(30)
        log.close()
    text = (tmp_path / "engine.log").read_text()
    assert "--enforce-eager accepted and ignored" in text
    assert "--compilation-config accepted and ignored" in text


def test_a_kv_cache_dtype_it_cannot_honour_is_one_clear_line(
    infergate_cli: list[str], tiny_model_dir: Path
) -> None:
    result = subprocess.run(
        [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--kv-cache-dtype", "fp8"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--kv-cache-dtype fp8" in result.stderr and "Traceback" not in result.stderr
