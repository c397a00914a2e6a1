"""Conformance echo backend: answers any method and path with JSON naming who served it.

GIE's conformance backends are echo servers, not model servers: a test learns which pod
and which port (data-parallel rank) served a request from the body, so routing can be
checked exactly. This one reports the same facts as Gateway API's ``echo-basic``
(``pod``, ``namespace``, ``path``, ``method``, ``host``, ``headers``, ``httpPort``) plus
``podIP`` and, for an OpenAI-style JSON body, the ``model`` it named.

Identity comes from flags or, as in a Pod spec, the ``POD_NAME``, ``NAMESPACE`` and
``POD_IP`` environment variables. ``--port`` may repeat: one process then serves several
ranks, each port on its own thread (a pod with several containers, in one process).
Standard library only, so the image stays tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 16 << 20


class Identity:
    """Who this echo server says it is."""

    def __init__(self, pod: str, namespace: str, pod_ip: str) -> None:
        self.pod = pod
        self.namespace = namespace
        self.pod_ip = pod_ip


def _model_of(body: bytes, content_type: str) -> str | None:
    if not body or "json" not in content_type:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def make_handler(identity: Identity, http_port: int) -> type[BaseHTTPRequestHandler]:
    class EchoHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as Envoy's upstream pool expects
        server_version = "infergate-echo"

        def _read_body(self) -> bytes | None:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = []
                size = 0
                while True:
                    line = self.rfile.readline(1024).strip()
                    length = int(line.split(b";")[0] or b"0", 16)
                    if length == 0:
                        self.rfile.readline(1024)
                        break
                    size += length
                    if size > MAX_BODY_BYTES:
                        return None
                    chunks.append(self.rfile.read(length))
                    self.rfile.readline(1024)
                return b"".join(chunks)
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                return None
            return self.rfile.read(length) if length else b""

        def _answer(self) -> None:
            try:
                body = self._read_body()
            except ValueError:
                self._send(400, {"error": "malformed chunked body"})
                return
            if body is None:
                self._send(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
                return
            headers: dict[str, list[str]] = {}
            for name, value in self.headers.items():
                headers.setdefault(name.title(), []).append(value)
            self._send(
                200,
                {
                    "path": self.path,
                    "host": self.headers.get("Host", ""),
                    "method": self.command,
                    "proto": self.request_version,
                    "headers": headers,
                    "namespace": identity.namespace,
                    "pod": identity.pod,
                    "podIP": identity.pod_ip,
                    "httpPort": str(http_port),
                    "bodyBytes": len(body),
                    "model": _model_of(body, self.headers.get("Content-Type", "")),
                },
            )

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = _answer

        def log_message(self, format: str, *args: Any) -> None:
            if os.environ.get("ECHO_ACCESS_LOG"):
                super().log_message(format, *args)

    return EchoHandler


def serve(host: str, ports: Sequence[int], identity: Identity) -> list[ThreadingHTTPServer]:
    """Start one server per port on background threads; return them (call shutdown())."""
    servers = []
    for port in ports:
        server = ThreadingHTTPServer((host, port), make_handler(identity, port))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name=f"echo-{port}", daemon=True).start()
        servers.append(server)
    return servers


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=os.environ.get("ECHO_HOST", "0.0.0.0"))
    parser.add_argument(
        "--port",
        type=int,
        action="append",
        help="port to serve; may repeat (default: $HTTP_PORT or 3000)",
    )
    parser.add_argument("--pod-name", default=os.environ.get("POD_NAME", "echo"))
    parser.add_argument("--namespace", default=os.environ.get("NAMESPACE", "default"))
    parser.add_argument("--pod-ip", default=os.environ.get("POD_IP", ""))
    args = parser.parse_args(argv)
    ports = args.port or [int(os.environ.get("HTTP_PORT", "3000"))]
    pod_ip = args.pod_ip or (args.host if args.host not in ("0.0.0.0", "::") else "")
    try:
        servers = serve(args.host, ports, Identity(args.pod_name, args.namespace, pod_ip))
    except OSError as error:
        print(f"echo: cannot listen on {args.host}:{ports}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"echo {args.pod_name} serving on {args.host} ports {ports}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    for server in servers:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
