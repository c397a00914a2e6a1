"""``infergate epp`` as a real process: serving, health, clean shutdown, config errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infergate.procs import free_port, http_ready, tcp_ready

from .conftest import Stream, body, headers, set_headers


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


async def test_epp_process_routes_and_stops_cleanly(
    processes, infergate_cli, tmp_path: Path
) -> None:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints: []\n")
    argv = [
        *infergate_cli,
        "epp",
        "--endpoints",
        str(endpoints),
        "--host",
        "127.0.0.1",
        "--grpc-port",
        str(grpc_port),
        "--grpc-health-port",
        str(health_port),
        "--metrics-port",
        str(metrics_port),
    ]
    process = processes.start(
        "epp", argv, ready=http_ready(f"http://127.0.0.1:{metrics_port}/metrics"), timeout=60
    )
    assert tcp_ready("127.0.0.1", grpc_port)()
    assert _health(health_port) == health_pb2.HealthCheckResponse.NOT_SERVING

    endpoints.write_text("endpoints:\n- {address: 127.0.0.1, port: 18555}\n")
    import time

    deadline = time.monotonic() + 20
    while _health(health_port) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "health never turned SERVING"
        time.sleep(0.1)

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    stream = Stream(channel)
    await stream.send(
        headers({":method": "POST", ":path": "/v1/completions"}),
        body(b'{"model": "m", "prompt": "hi"}'),
    )
    header_response, _ = await stream.recv(2)
    assert set_headers(header_response)["x-gateway-destination-endpoint"] == "127.0.0.1:18555"
    await channel.close()

    assert process.stop(grace=10) == 0, process.log_tail()
    assert "shutting down" in process.log_tail()


def test_bad_config_names_the_field(infergate_cli, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "kind: EndpointPickerConfig\nplugins:\n- type: prefix-cache-scorer\n"
        "  parameters: {blockSizeTokens: -3}\n"
    )
    result = subprocess.run(
        [*infergate_cli, "epp", "--endpoint", "127.0.0.1:1", "--config-file", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "plugins[0].parameters.blockSizeTokens" in result.stderr


def test_needs_exactly_one_endpoint_source(infergate_cli) -> None:
    result = subprocess.run([*infergate_cli, "epp"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "exactly one of" in result.stderr


def test_durations_accept_seconds_and_go_style() -> None:
    import pytest
    from infergate.epp.cli import parse_duration

    assert parse_duration("0.05", "f") == 0.05
    assert parse_duration("50ms", "f") == 0.05
    assert parse_duration("2s", "f") == 2.0
    assert parse_duration("1m", "f") == 60.0
    for bad in ("fast", "0", "-1s", "5h"):
        with pytest.raises(ValueError):
            parse_duration(bad, "--refresh-metrics-interval")
