"""Conformance echo backend: answers any method and path with JSON naming who served it.

GIE's conformance backends are echo servers, not model servers: a test learns which pod
and which port (data-parallel rank) served a request from the body, so routing can be
checked exactly. This one reports the same facts as Gateway API's ``echo-basic``
(``pod``, ``namespace``, ``path``, ``method``, ``proto``, ``host``, ``headers``,
``httpPort``) plus ``podIP`` and, for an OpenAI-style JSON body, the ``model`` it named.
Like ``echo-basic`` it sets the response headers a request asks for in
``X-Echo-Set-Header: name:value,name:value`` (GIE's suite sends that header on every
request, and its reference EPP uses it).

Two kinds of port, as ``echo-basic`` has:

* HTTP/1.1 ports (``--port``, repeatable; default ``$HTTP_PORT`` or 3000), one thread each:
  several data-parallel ranks in one process;
* h2c ports (``--h2c-port``, repeatable, or ``$H2C_PORT``): HTTP/2 over cleartext with
  prior knowledge, for InferencePools with ``appProtocol: kubernetes.io/h2c``. An HTTP/1
  request there is answered 400 ``Expected h2c request``, so a gateway that ignores the
  pool's appProtocol fails visibly; the JSON of an answered request says ``proto:
  HTTP/2.0``.

Identity comes from flags or, as in a Pod spec, the ``POD_NAME``, ``NAMESPACE`` and
``POD_IP`` environment variables. HTTP/1.1 needs only the standard library; h2c needs the
``h2`` package (imported only when an h2c port is asked for).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import socketserver
import sys
import threading
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

MAX_BODY_BYTES = 16 << 20
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SET_HEADER = "x-echo-set-header"


class Identity:
    """Who this echo server says it is."""

    def __init__(self, pod: str, namespace: str, pod_ip: str) -> None:
        self.pod = pod
        self.namespace = namespace
        self.pod_ip = pod_ip


class Shutdown(Protocol):
    """What :func:`serve` hands back for each port: something to stop."""

    def shutdown(self) -> None: ...

    def server_close(self) -> None: ...


def _model_of(body: bytes, content_type: str) -> str | None:
    if not body or "json" not in content_type:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def echo_payload(
    identity: Identity,
    port: int,
    *,
    method: str,
    path: str,
    host: str,
    proto: str,
    headers: Iterable[tuple[str, str]],
    body: bytes,
) -> dict[str, Any]:
    """The JSON body both protocols answer with (echo-basic's fields and ours)."""
    grouped: dict[str, list[str]] = {}
    content_type = ""
    for name, value in headers:
        grouped.setdefault(name.title(), []).append(value)
        if name.lower() == "content-type":
            content_type = value
    return {
        "path": path,
        "host": host,
        "method": method,
        "proto": proto,
        "headers": grouped,
        "namespace": identity.namespace,
        "pod": identity.pod,
        "podIP": identity.pod_ip,
        "httpPort": str(port),
        "bodyBytes": len(body),
        "model": _model_of(body, content_type),
    }


def requested_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Response headers asked for with ``X-Echo-Set-Header: a:1,b:2`` (echo-basic's
    contract: repeated names are joined with commas)."""
    found: dict[str, str] = {}
    for name, value in headers:
        if name.lower() != SET_HEADER:
            continue
        for item in value.split(","):
            key, _, val = item.strip().partition(":")
            if not key.strip():
                continue
            key = key.strip().lower()
            found[key] = f"{found[key]},{val.strip()}" if key in found else val.strip()
    return list(found.items())


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
            headers = list(self.headers.items())
            payload = echo_payload(
                identity, http_port, method=self.command, path=self.path,
                host=self.headers.get("Host", ""), proto=self.request_version,
                headers=headers, body=body,
            )  # fmt: skip
            self._send(200, payload, requested_headers(headers))

        def _send(
            self, status: int, payload: dict[str, Any], extra: Sequence[tuple[str, str]] = ()
        ) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            for name, value in extra:
                self.send_header(name, value)
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


class _H2Stream:
    """One HTTP/2 request being received, then its answer being sent."""

    def __init__(self, headers: list[tuple[str, str]]) -> None:
        self.headers = headers
        self.body = bytearray()
        self.pending = b""  # answer bytes waiting for flow-control window


class H2cConnection:
    """Serve one h2c (prior knowledge) connection with the ``h2`` state machine; an
    HTTP/1 request gets 400, as echo-basic's h2c port answers it."""

    def __init__(self, sock: socket.socket, identity: Identity, port: int) -> None:
        self.sock = sock
        self.identity = identity
        self.port = port
        self.streams: dict[int, _H2Stream] = {}

    def run(self) -> None:
        first = self._read_preface()
        if first is None:
            return
        if not first.startswith(H2_PREFACE):
            self._refuse_http1()
            return
        import h2.config
        import h2.connection

        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.conn.initiate_connection()
        self._flush()
        data = first
        while data:
            if not self._receive(data):
                return
            self._flush()
            data = self.sock.recv(65536)

    def _read_preface(self) -> bytes | None:
        """Read until the HTTP/2 preface can be told from an HTTP/1 request line."""
        data = b""
        while len(data) < len(H2_PREFACE) and H2_PREFACE.startswith(data):
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        return data

    def _refuse_http1(self) -> None:
        text = b"Expected h2c request"
        self.sock.sendall(
            b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + f"Content-Length: {len(text)}\r\n\r\n".encode()
            + text
        )

    def _receive(self, data: bytes) -> bool:
        import h2.events

        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.streams[event.stream_id] = _H2Stream(
                    [(str(k), str(v)) for k, v in event.headers or ()]
                )
            elif isinstance(event, h2.events.DataReceived):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.body += event.data or b""
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self._answer(event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated):
                self._send_pending()
            elif isinstance(event, h2.events.StreamReset):
                self.streams.pop(event.stream_id, None)
            elif isinstance(event, h2.events.ConnectionTerminated):
                return False
        return True

    def _answer(self, stream_id: int) -> None:
        stream = self.streams[stream_id]
        pseudo = {k: v for k, v in stream.headers if k.startswith(":")}
        regular = [(k, v) for k, v in stream.headers if not k.startswith(":")]
        payload = echo_payload(
            self.identity, self.port, method=pseudo.get(":method", ""),
            path=pseudo.get(":path", ""), host=pseudo.get(":authority", ""),
            proto="HTTP/2.0", headers=regular, body=bytes(stream.body),
        )  # fmt: skip
        data = json.dumps(payload).encode()
        response = [
            (":status", "200"),
            *requested_headers(regular),
            ("content-type", "application/json"),
            ("content-length", str(len(data))),
        ]
        self.conn.send_headers(stream_id, response)
        stream.pending = data
        self._send_pending()

    def _send_pending(self) -> None:
        """Send what flow control allows now; the rest on the next WINDOW_UPDATE."""
        for stream_id, stream in list(self.streams.items()):
            if not stream.pending:
                continue
            window = min(
                self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size
            )
            while stream.pending and window > 0:
                chunk, stream.pending = stream.pending[:window], stream.pending[window:]
                self.conn.send_data(stream_id, chunk, end_stream=not stream.pending)
                window = min(
                    self.conn.local_flow_control_window(stream_id),
                    self.conn.max_outbound_frame_size,
                )
            if not stream.pending:
                del self.streams[stream_id]

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)


def make_h2c_server(host: str, port: int, identity: Identity) -> socketserver.ThreadingTCPServer:
    """A threaded TCP server whose every connection is an :class:`H2cConnection`."""
    from h2.exceptions import H2Error  # fail at start, not at the first request

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            try:
                H2cConnection(self.request, identity, port).run()
            except (OSError, ValueError, H2Error) as error:  # a peer that breaks the protocol
                if os.environ.get("ECHO_ACCESS_LOG"):
                    print(f"h2c connection ended: {error!r}", file=sys.stderr)

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    server = socketserver.ThreadingTCPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(
    host: str, ports: Sequence[int], identity: Identity, h2c_ports: Sequence[int] = ()
) -> list[Shutdown]:
    """Start one server per port on background threads; return them (call shutdown())."""
    servers: list[Any] = []
    for port in ports:
        server = ThreadingHTTPServer((host, port), make_handler(identity, port))
        server.daemon_threads = True
        servers.append(server)
    servers += [make_h2c_server(host, port, identity) for port in h2c_ports]
    for server in servers:
        port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name=f"echo-{port}", daemon=True).start()
    return servers


def _ports(values: list[int] | None, env: str, default: str) -> list[int]:
    if values:
        return values
    raw = os.environ.get(env, default)
    return [int(raw)] if raw else []


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--host", default=os.environ.get("ECHO_HOST", "0.0.0.0"))
    parser.add_argument(
        "--port", type=int, action="append",
        help="HTTP/1.1 port to serve; may repeat (default: $HTTP_PORT or 3000)",
    )  # fmt: skip
    parser.add_argument(
        "--h2c-port", type=int, action="append",
        help="h2c (HTTP/2 prior knowledge) port to serve; may repeat (default: $H2C_PORT, if set)",
    )  # fmt: skip
    parser.add_argument("--pod-name", default=os.environ.get("POD_NAME", "echo"))
    parser.add_argument("--namespace", default=os.environ.get("NAMESPACE", "default"))
    parser.add_argument("--pod-ip", default=os.environ.get("POD_IP", ""))
    args = parser.parse_args(argv)
    ports = _ports(args.port, "HTTP_PORT", "3000")
    h2c_ports = _ports(args.h2c_port, "H2C_PORT", "")
    pod_ip = args.pod_ip or (args.host if args.host not in ("0.0.0.0", "::") else "")
    try:
        servers = serve(
            args.host, ports, Identity(args.pod_name, args.namespace, pod_ip), h2c_ports
        )
    except (OSError, ImportError) as error:
        print(f"echo: cannot serve on {args.host}:{ports}+h2c{h2c_ports}: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"echo {args.pod_name} serving on {args.host} ports {ports} h2c {h2c_ports}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    for server in servers:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
