"""``infergate epp --workers 2``: two processes behind one ext-proc port, both serving.

Real processes and real gRPC: 16 client connections (not shared: a local subchannel pool
each) route one request each; the kernel spreads connections over the two workers
(SO_REUSEPORT), and each worker's own metrics port (``--metrics-port + i``) shows the
requests it routed. SIGTERM to the parent stops both.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from infergate.procs import free_ports, tcp_ready

CONNECTIONS = 16


def _free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` both free, below the kernel's ephemeral range
    (32768 and up here): worker 1 serves metrics on ``--metrics-port + 1``, and a port
    in the ephemeral range can be taken meanwhile by any outgoing connection (CI's run
    failed once so: "Address already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for base in random.sample(range(max(1024, low - 12000), low - 2), 200):
        pair = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
        try:
            for offset, sock in enumerate(pair):
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in pair:
                sock.close()
    raise RuntimeError("no two consecutive free ports below the ephemeral range")


def _routed(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("infergate_epp_requests_total") and 'outcome="routed"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _route_once(port: int) -> bool:
    hv = [
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
    ]
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(
            pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv))
            )
        )
        await call.write(
            pb.ProcessingRequest(
                request_body=pb.HttpBody(body=b'{"model":"m","prompt":"hi"}', end_of_stream=True)
            )
        )
        reply = await asyncio.wait_for(call.read(), 20)
        call.cancel()
        return reply is not grpc.aio.EOF and reply.HasField("request_headers")


def test_two_workers_share_one_port_and_both_route(tmp_path: Path) -> None:
    grpc_port, health = free_ports(2)
    metrics = _free_port_pair()  # worker 1 serves metrics on metrics + 1
    argv = [str(Path(sys.executable).with_name("infergate")), "epp", "--endpoint", "127.0.0.1:1"]
    argv += ["--host", "127.0.0.1", "--grpc-port", str(grpc_port)]
    argv += ["--grpc-health-port", str(health), "--metrics-port", str(metrics), "--workers", "2"]
    log = tmp_path / "epp.log"
    with log.open("wb") as sink:
        parent = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (tcp_ready("127.0.0.1", metrics)() and tcp_ready("127.0.0.1", metrics + 1)()):
            assert parent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        time.sleep(1.0)  # both bound their gRPC port too (it opens before metrics)

        async def run() -> list[bool]:
            return list(await asyncio.gather(*(_route_once(grpc_port) for _ in range(CONNECTIONS))))

        assert all(asyncio.run(run()))
        per_worker = [_routed(metrics), _routed(metrics + 1)]
        assert sum(per_worker) == CONNECTIONS, per_worker
        assert all(n > 0 for n in per_worker), per_worker
    finally:
        parent.send_signal(signal.SIGTERM)
        parent.wait(20)
    assert "Traceback" not in log.read_text()
