"""A real Gateway Envoy on ADS, its backends and hand-built snapshots, on one machine.

Shared by the xDS tests and ``benchmarks/gateway_route_change.py`` so both measure the
same thing: an :class:`~infergate.gateway.xds.AdsServer` on a background event loop
(as the operator's would be), Envoys started from :mod:`infergate.gateway.bootstrap`,
and small streaming (SSE) HTTP backends that say who answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from infergate.envoy.binary import find_envoy
from infergate.gateway.bootstrap import GatewayProxy, gateway_proxy_args, render_gateway_bootstrap
from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    Obj,
    Snapshot,
)
from infergate.procs import ManagedProcess, ProcessGroup, http_ready

T = TypeVar("T")

_T = "type.googleapis.com/envoy."
_HCM = _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = _T + "extensions.filters.http.router.v3.Router"
_ADS = {"ads": {}, "resource_api_version": "V3"}

DONE_EVENT = b"data: [DONE]\n\n"


# -- backends ----------------------------------------------------------------------------


class SseBackend:
    """An HTTP/1.1 server named ``name``: ``GET /sse?events=N&interval_ms=M`` streams N
    SSE events then ``[DONE]``; any other path answers ``{"backend": name}``.

    With ``&hold=1`` the stream stops after its first event until :attr:`gate` is set,
    so a test knows a stream is in flight across a config change, without timing it."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.name = name
        self.gate = threading.Event()
        self._server = _QuietServer((host, port), _handler(name, self.gate))
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-stream (a cut stream, what the tests look for) is
    not an error of the backend: no traceback on stderr.

    A listen backlog like a real server's: a cluster Envoy re-creates opens all its
    connections at once, and socketserver's default of 5 would drop SYNs (each then
    costing a 1 s retransmit) and blame the config change for a backend limit."""

    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


def _handler(name: str, gate: threading.Event) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes: with Nagle on, the body would wait
        # for the proxy's delayed ACK (~40 ms) and every answer would look that slow.
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/sse":
                query = parse_qs(url.query)
                events = int(query.get("events", ["10"])[0])
                interval = int(query.get("interval_ms", ["20"])[0]) / 1000
                self._stream(events, interval, hold=query.get("hold") == ["1"])
            else:
                body = json.dumps({"backend": name}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def _stream(self, events: int, interval: float, hold: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for index in range(events):
                self._chunk(f"data: {json.dumps({'backend': name, 'i': index})}\n\n".encode())
                if hold and index == 0:
                    gate.wait(60)
                else:
                    time.sleep(interval)
            self._chunk(DONE_EVENT)
            self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def check_sse(body: bytes, events: int) -> str | None:
    """The backend that streamed ``body`` when it is complete and from one backend, else None."""
    if not body.endswith(DONE_EVENT):
        return None
    lines = [line for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    if len(lines) != events:
        return None
    backends = {json.loads(line[6:])["backend"] for line in lines}
    indexes = [json.loads(line[6:])["i"] for line in lines]
    if len(backends) != 1 or indexes != list(range(events)):
        return None
    return str(backends.pop())


# -- snapshots ---------------------------------------------------------------------------


def eds_cluster(name: str, *, connect_timeout: str = "1s") -> Obj:
    """An EDS cluster over ADS that waits for its endpoints forever (no initial fetch
    timeout): a server that failed to answer a warming cluster would hang a test instead
    of passing 15 s later on Envoy's default timeout."""
    return {
        "name": name,
        "type": "EDS",
        "connect_timeout": connect_timeout,
        "eds_cluster_config": {"eds_config": {**_ADS, "initial_fetch_timeout": "0s"}},
    }


def assignment(name: str, endpoints: Sequence[tuple[str, int]]) -> Obj:
    lb_endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in endpoints
    ]
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]}


def http_listener(name: str, port: int, route_config: str, address: str = "0.0.0.0") -> Obj:
    """An HTTP listener whose routes come over RDS (so a route change is an RDS update)."""
    hcm = {
        "@type": _HCM,
        "stat_prefix": name,
        "codec_type": "AUTO",
        "rds": {"route_config_name": route_config, "config_source": _ADS},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "name": name,
        "address": {"socket_address": {"address": address, "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def route_config(name: str, cluster: str, *, regex: str | None = None) -> Obj:
    """Every request to ``cluster`` (matched by prefix ``/``, or by ``regex`` when given)."""
    match: Obj = {"safe_regex": {"regex": regex}} if regex is not None else {"prefix": "/"}
    return {
        "name": name,
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [{"match": match, "route": {"cluster": cluster, "timeout": "0s"}}],
            }
        ],
    }


def snapshot(
    *,
    listeners: Sequence[Obj] = (),
    routes: Sequence[Obj] = (),
    clusters: Sequence[Obj] = (),
    assignments: Sequence[Obj] = (),
) -> Snapshot:
    return Snapshot(
        {
            CLUSTER_TYPE: tuple(clusters),
            ENDPOINT_TYPE: tuple(assignments),
            LISTENER_TYPE: tuple(listeners),
            ROUTE_TYPE: tuple(routes),
        }
    )


def route_snapshot(
    listen_port: int, backends: Mapping[str, SseBackend], route_to: str, *, regex: str | None = None
) -> Snapshot:
    """One listener, one route to cluster ``route_to``, one EDS cluster per backend."""
    return snapshot(
        listeners=[http_listener("http", listen_port, "routes")],
        routes=[route_config("routes", route_to, regex=regex)],
        clusters=[eds_cluster(name) for name in backends],
        assignments=[assignment(name, [(b.host, b.port)]) for name, b in backends.items()],
    )


# -- processes ---------------------------------------------------------------------------


class BackgroundLoop:
    """An event loop on its own thread: where the ADS server runs in tests and benchmarks,
    as it runs on the operator's loop while the rest of the program does other work."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def start_gateway_envoy(
    group: ProcessGroup,
    workdir: Path,
    *,
    name: str,
    node_id: str,
    xds_port: int,
    admin_port: int,
    bind_address: str | None = None,
    ready_port: int | None = None,
    timeout: float = 60.0,
    ready: bool = True,
) -> ManagedProcess:
    """A Gateway Envoy on this machine; with ``ready``, waits until it has its config."""
    proxy = GatewayProxy(
        node_id=node_id,
        xds_host="127.0.0.1",
        xds_port=xds_port,
        admin_port=admin_port,
        ready_port=ready_port,
        ready_address="127.0.0.1",
    )
    path = workdir / f"{name}.json"
    path.write_text(render_gateway_bootstrap(proxy))
    argv = [
        str(find_envoy()),
        *gateway_proxy_args(
            path, bind_address=bind_address, concurrency=1, log_level="warn", drain_time_s=60
        ),
    ]
    process = SpawnedProcess(name, argv, log_path=workdir / f"{name}.log")
    group.processes.append(process)
    process.start()
    if ready:
        process.wait_ready(http_ready(f"http://127.0.0.1:{admin_port}/ready"), timeout=timeout)
    return process


class SpawnedProcess(ManagedProcess):
    """A child started with no Python code between fork and exec.

    The ADS server's gRPC threads live in this process. ManagedProcess asks for a
    parent-death signal in a ``preexec_fn``, which makes subprocess fork() (rather than
    vfork) and run gRPC's fork handlers and Python in the child: now and then the child
    crashed (SIGSEGV, SIGABRT) before it could exec Envoy. Here the child execs at once
    (vfork) and ``setpriv --pdeathsig`` asks for the signal instead, when installed."""

    def start(self) -> ManagedProcess:
        if self.log_path is None:
            descriptor, path = tempfile.mkstemp(prefix=f"infergate-{self.name}-", suffix=".log")
            os.close(descriptor)
            self.log_path = Path(path)
        setpriv = shutil.which("setpriv")
        argv = [setpriv, "--pdeathsig", "TERM", *self.argv] if setpriv else list(self.argv)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if self.env is None else dict(self.env),
                cwd=self.cwd,
                start_new_session=True,
            )
        return self


def main(argv: Sequence[str] | None = None) -> None:
    """Serve one :class:`SseBackend` until SIGTERM: what a pod runs when a benchmark on
    the control plane needs a streaming backend behind a Service (see
    ``conformance/drivers/runtime.py``, images named ``sse-backend``)."""
    parser = argparse.ArgumentParser(description="an SSE backend that names itself")
    parser.add_argument("--name", required=True, help="what it answers as its backend name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    backend = SseBackend(args.name, args.host, args.port)
    print(f"sse backend {args.name} on {args.host}:{backend.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    backend.close()


if __name__ == "__main__":
    main()
