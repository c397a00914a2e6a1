"""``infergate up`` as a user runs it: a process that serves OpenAI requests through Envoy,
that ``infergate bench serve`` can load, and that stops everything on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from infergate.envoy.bootstrap import UPSTREAM_HOST_HEADER
from infergate.procs import ProcessGroup, free_port, tcp_ready
from infergate.stack.local import ensure_tiny_model, port_in_use


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XDG cache already holding the tiny model, as a second `infergate up` would find."""
    home = tmp_path_factory.mktemp("xdg-cache")
    ensure_tiny_model(home / "infergate")
    return home


def test_up_serves_benchmarks_and_stops_cleanly_on_sigint(
    processes: ProcessGroup, infergate_cli: list[str], cache_home: Path, tmp_path: Path
) -> None:
    ports = {
        name: free_port()
        for name in (
            "--port",
            "--admin-port",
            "--engine-port",
            "--epp-grpc-port",
            "--epp-health-port",
            "--epp-metrics-port",
        )
    }
    # Engines take consecutive ports from --engine-port: make sure the second is free too.
    while port_in_use(ports["--engine-port"] + 1):
        ports["--engine-port"] = free_port()
    log = tmp_path / "up.log"
    workdir = tmp_path / "work"
    argv = [*infergate_cli, "up", "--engines", "2", "--workdir", str(workdir)]
    argv += ["--epp-arg=--log-level=debug"]  # passed through: one log line per decision
    for flag, value in ports.items():
        argv += [flag, str(value)]
    up = processes.start(
        "infergate-up",
        argv,
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home), "COLUMNS": "200"},
        log_path=log,
        ready=lambda: "infergate up: ready" in log.read_text(errors="replace"),
        timeout=180,
    )
    base = f"http://127.0.0.1:{ports['--port']}"
    output = log.read_text()
    assert "curl" in output and "from openai import OpenAI" in output

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="infergate-tiny", prompt="Hello through the whole stack", max_tokens=5
    )
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    engine_ports = {ports["--engine-port"], ports["--engine-port"] + 1}
    assert int(raw.headers[UPSTREAM_HOST_HEADER].rsplit(":", 1)[1]) in engine_ports

    assert f"picked={raw.headers[UPSTREAM_HOST_HEADER]}" in (workdir / "epp.log").read_text()

    result_file = tmp_path / "bench.json"
    bench = subprocess.run(
        [
            *infergate_cli,
            "bench",
            "serve",
            "--base-url",
            base,
            "--dataset",
            "shared-prefix",
            "--num-prompts",
            "24",
            "--num-prefix-groups",
            "3",
            "--prefix-len",
            "200",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--request-rate",
            "30",
            "--tokenizer",
            str(cache_home / "infergate" / "tiny-llama"),
            "--disable-tqdm",
            "--result-file",
            str(result_file),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "Serving Benchmark Result" in bench.stdout
    result = json.loads(result_file.read_text())
    assert result["completed"] == 24 and result["failed"] == 0
    assert result["model_id"] == "infergate-tiny"
    assert result["total_output_tokens"] == sum(result["output_lens"]) == 24 * 8
    assert result["total_input_tokens"] == sum(result["input_lens"]) > 24 * 200
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p90_{metric}_ms"]
        assert result[f"p90_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert result["request_throughput"] == pytest.approx(24 / result["duration"])

    assert up.popen is not None
    up.popen.send_signal(signal.SIGINT)
    assert up.popen.wait(timeout=60) == 0
    assert "infergate up: stopped" in log.read_text()
    for port in (*engine_ports, ports["--epp-grpc-port"], ports["--port"]):
        assert not tcp_ready("127.0.0.1", port)(), f"port {port} still served after SIGINT"


def test_up_names_the_component_that_failed(
    infergate_cli: list[str], cache_home: Path, tmp_path: Path
) -> None:
    bad_config = tmp_path / "epp.yaml"
    bad_config.write_text("plugins:\n- type: no-such-plugin\n")
    result = subprocess.run(
        [
            *infergate_cli,
            "up",
            "--engines",
            "1",
            "--epp-config",
            str(bad_config),
            *("--port", str(free_port()), "--admin-port", str(free_port())),
            *("--engine-port", str(free_port()), "--epp-grpc-port", str(free_port())),
            *("--epp-health-port", str(free_port()), "--epp-metrics-port", str(free_port())),
        ],
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 1
    assert "epp failed to start" in result.stdout + result.stderr
    assert "no-such-plugin" in result.stdout + result.stderr


def test_up_refuses_a_busy_port(infergate_cli: list[str]) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        result = subprocess.run(
            [*infergate_cli, "up", "--port", str(busy)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1
    assert f"port {busy} (Envoy listener) is already in use" in result.stdout + result.stderr
