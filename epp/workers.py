"""``infergate epp --workers N``: N EPP processes behind one ext-proc port.

Each worker is a whole EPP (its own datastore, scrapes, prefix index, flow control,
completion subscriptions) bound to the same gRPC and health ports with SO_REUSEPORT; the
kernel hands each new *connection* to one of them. Envoy multiplexes every ext-proc
stream of one of its worker threads over one HTTP/2 connection, so streams spread over
the EPP workers only as far as Envoy opens several connections: one per Envoy worker
thread (``--concurrency``), more when the EPP cluster caps streams per connection
(``EnvoyConfig(epp_streams_per_connection=...)``), or one per Envoy replica.
State is per process, as with several replicas: fairness and flow-control order hold
within a worker; prefix knowledge and load are shared through the engines (admission
records, load reports; docs/epp.md, "Several replicas"). Worker i serves metrics on ``--metrics-port + i``.

The parent only supervises: SIGTERM/SIGINT go to every worker; if one exits, the others
are stopped and the parent exits with its status (a supervisor restarts the whole set).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence


def worker_argv(argv: Sequence[str], index: int, metrics_port: int) -> list[str]:
    """This process's command line for worker ``index`` (later flags win in Click)."""
    port = metrics_port + index if metrics_port > 0 else metrics_port
    return [
        sys.executable, "-m", "infergate.cli", *argv,
        "--workers", "1", "--reuse-port", "--metrics-port", str(port),
    ]  # fmt: skip


def run_workers(argv: Sequence[str], workers: int, metrics_port: int) -> int:
    children = [subprocess.Popen(worker_argv(argv, i, metrics_port)) for i in range(workers)]
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    status = 0
    while True:
        exited = [child for child in children if child.poll() is not None]
        if exited:
            status = status or next((c.returncode for c in exited if c.returncode), 0)
            if not stopping:
                stop(signal.SIGTERM, None)
            if len(exited) == len(children):
                return status
        time.sleep(0.2)
