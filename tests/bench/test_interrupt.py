"""Ctrl-C on ``infergate bench serve``: the summary over the requests that had finished,
marked partial, and exit code 130 — a real SIGINT to a real process, loading a real
(simulated) engine."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from infergate.procs import ProcessGroup, free_port, http_ready
from infergate.stack.local import ensure_tiny_model
from tests.support.probes import metric_sum, wait_for

PROMPTS = 400


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def test_ctrl_c_prints_a_partial_summary_and_exits_130(
    processes: ProcessGroup, infergate_cli: list[str], model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [*infergate_cli, "engine", "serve", str(model_dir), "--simulate", "--port", str(port)]
    argv += ["--served-model-name", "tiny", "--max-num-seqs", "4", "--sim-base-ms", "20"]
    processes.start("engine", argv, ready=http_ready(f"{base}/health"), timeout=120)

    result_file = tmp_path / "bench.json"
    # 400 requests at 20 req/s against an engine that finishes ~10 req/s: 20 s and more.
    bench = subprocess.Popen(
        [*infergate_cli, "bench", "serve", "--base-url", base, "--num-prompts", str(PROMPTS),
         "--request-rate", "20", "--input-len", "16", "--output-len", "16", "--disable-tqdm",
         "--result-file", str(result_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As from a terminal: a test run started in the background (`pytest &`) ignores
        # SIGINT, which its children inherit, and Python then installs no Ctrl-C handler.
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        wait_for(
            lambda: metric_sum(f"{base}/metrics", "vllm:request_success_total") >= 5,
            timeout=60,
            what="5 finished requests",
        )
        assert bench.poll() is None, "the benchmark ended before Ctrl-C"
        bench.send_signal(signal.SIGINT)
        out, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert "Serving Benchmark Result (partial)" in out
    result = json.loads(result_file.read_text())
    assert result["partial"] is True and result["num_prompts"] == PROMPTS
    assert 5 <= result["completed"] < PROMPTS and result["failed"] == 0
    assert len(result["output_lens"]) == result["completed"] == len(result["ttfts"])
    assert result["total_output_tokens"] == sum(result["output_lens"])
    unfinished = PROMPTS - result["completed"]
    assert f"Unfinished requests (interrupted):{unfinished:>{50 - 34}}" in out
