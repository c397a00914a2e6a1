"""Drain an Envoy before the kubelet stops it: the Gateway pods' shutdown manager.

A pod being deleted gets SIGTERM in every container at once (after its preStop hook), and
Envoy exits on SIGTERM at once: its streams are cut, and a client that connects through a
Service whose endpoints have not yet dropped the pod is refused. Envoy drains only when
told to through its admin API, with ``POST`` (``/healthcheck/fail``,
``/drain_listeners``), and a Gateway's Envoy image holds nothing but the Envoy binary (no
shell, no HTTP client for an ``exec`` hook; Envoy's own distroless image neither), while a
kubelet ``httpGet`` hook can only ``GET``.

So, as Envoy Gateway and Contour do (their ``shutdown-manager`` sidecars: Envoy Gateway's
``/drain_listeners?graceful&skip_exit`` and ``/healthcheck/fail``, then it polls
Envoy's connection count for at least a minimum drain and at most a drain timeout;
Contour's the same with ``/healthcheck/fail``), a small process beside Envoy in the pod
drives the drain:

* on SIGTERM (what the kubelet sends it first: it has no hook) or on ``GET /shutdown`` it
  fails Envoy's health check (``/ready`` answers 503, so the kubelet marks the pod unready
  and every drain-close check in Envoy says yes) and starts a graceful listener drain:
  listeners keep accepting while endpoints propagate, every connection is closed after
  its response (HTTP/1 ``Connection: close``, HTTP/2 GOAWAY; the Gateway runs Envoy with
  ``--drain-strategy immediate``), streams in flight run on;
* it then waits until Envoy holds no connection, at least ``min_drain_s`` (a Service's
  endpoints, kube-proxy's rules and a cloud load balancer drop the pod on their own
  schedule) and at most ``drain_timeout_s``;
* Envoy's container has the preStop hook ``httpGet /shutdown``: it returns when the drain is
  done, and only then does the kubelet send Envoy SIGTERM. The pod's
  ``terminationGracePeriodSeconds`` is longer than ``drain_timeout_s``.

Istio does the same inside its agent (``pilot-agent`` drains on SIGTERM, then waits
``terminationDrainDuration``); kgateway's ``gracefulShutdown`` is a preStop ``exec`` of
``wget --post-data '' .../healthcheck/fail; sleep N``, which needs a shell in the image.

Only the standard library: the process idles for the pod's lifetime and starts in the
EPP image, which the operator already pulls.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

import typer

from infergate.options import command, option, to_argv

log = logging.getLogger("infergate.envoy.drain")

SHUTDOWN_PATH = "/shutdown"
HEALTH_PATH = "/healthz"
#: The admin calls that start the drain, in order (each a POST).
DRAIN_CALLS = ("/healthcheck/fail", "/drain_listeners?graceful&skip_exit")
#: Each listener's open connections (also per worker, which :data:`_PER_WORKER` skips).
ACTIVE_STAT = r"^listener\..*\.downstream_cx_active$"
_PER_WORKER = re.compile(r"\.worker_\d+\.downstream_cx_active$")
#: After the drain is done, how long the process still answers ``/shutdown`` (the kubelet's
#: hook may ask a moment after the SIGTERM that started it all).
LINGER_S = 1.0


@dataclass(frozen=True)
class DrainOptions:
    """``infergate envoy-drain``: where Envoy's admin API is, and how long to drain."""

    admin_url: str = option(
        "--admin-url", default="http://127.0.0.1:19000",
        help="Envoy's admin API (loopback in the pod).",
    )  # fmt: skip
    port: int = option(
        "--port", default=19002, min=1, max=65535,
        help="Port of GET /shutdown (Envoy's preStop hook) and GET /healthz.",
    )  # fmt: skip
    min_drain_s: float = option(
        "--min-drain-s", default=10.0, min=0.0,
        help="Keep Envoy up at least this long after the drain starts, connections or not, "
        "while the pod's endpoints are removed everywhere.",
    )  # fmt: skip
    drain_timeout_s: float = option(
        "--drain-timeout-s", default=300.0, min=0.0,
        help="Stop waiting for Envoy's connections to close after this long: the longest a "
        "stream may run once the pod is deleted.",
    )  # fmt: skip
    poll_s: float = option(
        "--poll-s", default=1.0, min=0.05, help="How often Envoy's connections are counted."
    )

    def problem(self) -> str | None:
        """What makes these options unusable, or ``None``."""
        if not self.admin_url.startswith(("http://", "https://")):
            return f"--admin-url must be an http(s) URL, got {self.admin_url!r}"
        if self.drain_timeout_s < self.min_drain_s:
            return (
                f"--drain-timeout-s ({self.drain_timeout_s:g}) is shorter than --min-drain-s "
                f"({self.min_drain_s:g})"
            )
        return None

    def argv(self) -> list[str]:
        """``infergate``'s arguments that run this drainer (the operator's pod spec)."""
        return ["envoy-drain", *to_argv(self, always=("admin_url", "port", "drain_timeout_s"))]


class Drainer:
    """One drain per process: the first trigger starts it, every caller waits for its end."""

    def __init__(self, options: DrainOptions) -> None:
        self.options = options
        self.done = threading.Event()
        self._started = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the drain in the background unless it already runs (idempotent)."""
        with self._started:
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="drain", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        o = self.options
        began = time.monotonic()
        for path in DRAIN_CALLS:
            try:
                self._admin(path, method="POST")
            except (OSError, urllib.error.URLError) as error:
                log.warning("POST %s%s: %s", o.admin_url, path, error)
        log.info("drain started; waiting %.0f-%.0f s for connections", o.min_drain_s,
                 o.drain_timeout_s)  # fmt: skip
        left = -1
        while time.monotonic() - began < o.drain_timeout_s:
            left = self.connections()
            if left == 0 and time.monotonic() - began >= o.min_drain_s:
                break
            time.sleep(o.poll_s)
        log.info("drain done after %.1f s, %d connections left", time.monotonic() - began, left)
        self.done.set()

    def connections(self) -> int:
        """Envoy's open downstream connections on its listeners (the admin API's own
        excluded); -1 if the admin API does not answer (an Envoy that is slow may still
        hold some: keep waiting). ``server.total_connections`` stays 0 with
        ``--disable-hot-restart``, as the Gateway runs Envoy: each listener's
        ``downstream_cx_active`` is summed instead."""
        try:
            text = self._admin("/stats?filter=" + urllib.parse.quote(ACTIVE_STAT))
        except (OSError, urllib.error.URLError):
            return -1
        total = 0
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name.startswith("listener.admin.") or _PER_WORKER.search(name):
                continue
            total += int(value.strip() or 0)
        return total

    def _admin(self, path: str, method: str = "GET") -> str:
        request = urllib.request.Request(self.options.admin_url + path, method=method, data=None)
        with urllib.request.urlopen(request, timeout=5) as reply:
            body: bytes = reply.read()
        return body.decode(errors="replace")


def _handler(drainer: Drainer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == SHUTDOWN_PATH:
                drainer.start()
                drainer.done.wait()
                self._answer(200, "drained\n")
            elif self.path == HEALTH_PATH:
                self._answer(200, "ok\n")
            else:
                self._answer(404, "not found\n")

        def _answer(self, code: int, text: str) -> None:
            body = text.encode()
            self.send_response(code)
            self.send_header("content-type", "text/plain")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug(format, *args)

    return Handler


def run(options: DrainOptions) -> None:
    """Serve ``/shutdown`` and ``/healthz`` until a drain is done (SIGTERM starts one)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    drainer = Drainer(options)
    server = ThreadingHTTPServer(("0.0.0.0", options.port), _handler(drainer))
    server.daemon_threads = True

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        drainer.start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("serving %s on :%d for Envoy at %s", SHUTDOWN_PATH, options.port, options.admin_url)
    while not drainer.done.wait(1.0):
        pass  # a timed wait: the main thread runs the SIGTERM handler between waits
    time.sleep(LINGER_S)
    server.shutdown()


@command(DrainOptions)
def envoy_drain(options: DrainOptions) -> None:
    """Drain the Envoy of this pod when the pod stops (a Gateway's shutdown manager):
    SIGTERM or GET /shutdown fails its health check and drains its listeners, then waits
    for its connections to close; GET /shutdown answers once they have."""
    problem = options.problem()
    if problem is not None:
        raise typer.BadParameter(problem)
    run(options)
