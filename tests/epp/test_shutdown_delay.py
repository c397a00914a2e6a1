"""``infergate epp --shutdown-delay-s``: on SIGTERM the EPP first answers NOT_SERVING to the
health checks a proxy makes on its ext-proc port, while that port still accepts, and only
then stops (a Gateway's Envoy stops opening streams to it before it goes; docs/kubernetes.md,
"Rolling a Gateway's Envoy or an EPP"). A real process and real gRPC health checks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infergate.procs import free_port, tcp_ready

pytestmark = pytest.mark.timeout(120)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _liveness(port: int) -> int:
    """The ext-proc port's answer for ``liveness`` (what a Gateway's Envoy checks)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        return int(reply.status)


def test_sigterm_withdraws_from_health_checks_before_the_port_closes() -> None:
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    epp = subprocess.Popen(
        [sys.executable, "-m", "infergate.cli", "epp", "--endpoint", "127.0.0.1:9",
         "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
         "--metrics-port", str(metrics_port), "--shutdown-delay-s", "30"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not tcp_ready("127.0.0.1", grpc_port)():
            assert epp.poll() is None and time.monotonic() < deadline, "the EPP did not start"
            time.sleep(0.2)
        assert _liveness(grpc_port) == SERVING
        epp.send_signal(signal.SIGTERM)
        while _liveness(grpc_port) != NOT_SERVING:  # the port still answers meanwhile
            assert epp.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert epp.poll() is None  # withdrawn, not gone
    finally:
        epp.kill()
        epp.wait(timeout=30)
