"""``infergate bench serve`` refuses bad input with a one-line reason and exit status 1/2."""

from __future__ import annotations

import subprocess

from infergate.procs import free_port


def _run(infergate_cli: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*infergate_cli, "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_unreachable_server_is_reported(infergate_cli: list[str]) -> None:
    result = _run(infergate_cli, "--base-url", f"http://127.0.0.1:{free_port()}", "--disable-tqdm")
    assert result.returncode == 1
    assert "bench serve:" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_dataset_and_bad_flags(infergate_cli: list[str]) -> None:
    base = ["--base-url", "http://127.0.0.1:1"]
    missing = _run(infergate_cli, *base, "--dataset", "no-such-file.jsonl")
    assert missing.returncode == 1
    assert "not random, shared-prefix, or a file" in missing.stderr
    bad_goodput = _run(infergate_cli, *base, "--goodput", "ttft")
    assert bad_goodput.returncode == 2
    assert "NAME:MS" in bad_goodput.stderr
    bad_endpoint = _run(infergate_cli, *base, "--endpoint", "/v1/embeddings")
    assert bad_endpoint.returncode == 2
