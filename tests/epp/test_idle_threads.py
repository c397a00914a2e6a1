"""What an idle ``infergate epp`` process runs beside its event loop.

Every EPP replica pays its idle threads' wakeups whether it routes or not
(docs/benchmarks/scale.md, "Replicas"): grpc.aio's threads for the health port, the
metrics server's polling thread, the endpoints file watcher's thread, and a ZMQ I/O
thread receiving every engine's load reports. With ext-proc on ``--grpc-server h2`` (the
default) none of those threads exists; ZMQ's threads remain for the replica's own
completion records, which wake it anyway (a record ends a request).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

from infergate.procs import free_port, http_ready


def _thread_names(pid: int) -> list[str]:
    """The live threads' names. A thread may end between the listing and the read of its
    name (the readiness probe's, below): it is not running then, so it is left out."""
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return names


def _settled_thread_names(pid: int, main: str, deadline_s: float = 10.0) -> list[str]:
    """The names once start-up's threads have settled. Two are transient: libzmq starts its
    I/O thread at the feeds' first socket, after the EPP is ready, and a new thread carries
    the process's name until it renames itself; and the readiness probe's scrape is
    answered on a thread of its own (``ThreadingWSGIServer``), which ends after the reply.
    A thread that stays is still there at the deadline."""
    deadline = time.monotonic() + deadline_s
    names = _thread_names(pid)
    while time.monotonic() < deadline and ("ZMQbg/IO/0" not in names or names.count(main) > 1):
        time.sleep(0.05)
        names = _thread_names(pid)
    return names


def test_an_idle_epp_runs_no_thread_that_wakes_on_its_own(
    processes, infergate_cli, tmp_path: Path
) -> None:
    context = zmq.Context()
    engine = context.socket(zmq.PUB)  # an engine's completion-events port: both feeds dial it
    events_port = engine.bind_to_random_port("tcp://127.0.0.1")
    try:
        endpoints = tmp_path / "endpoints.yaml"  # watched for changes
        endpoints.write_text(
            "endpoints:\n- {address: 127.0.0.1, port: 18555, labels: "
            f"{{infergate.io/completion-events-port: '{events_port}'}}}}\n"
        )
        metrics_port = free_port()
        argv = [
            *infergate_cli, "epp", "--endpoints", str(endpoints), "--host", "127.0.0.1",
            "--grpc-port", str(free_port()), "--grpc-health-port", str(free_port()),
            "--metrics-port", str(metrics_port),
        ]  # fmt: skip
        process = processes.start(
            "epp", argv, ready=http_ready(f"http://127.0.0.1:{metrics_port}/metrics"), timeout=60
        )
        with open(f"/proc/{process.pid}/comm") as comm:
            main = comm.read().strip()
        names = _settled_thread_names(process.pid, main)
        assert names.count(main) == 1, " ".join(names)  # no Python thread beside the event loop's
        grpc_threads = {"event_engine", "grpc_global_tim", "lifeguard", "default-executo"}
        assert not grpc_threads & set(names), names
        assert not [n for n in names if n.startswith("notify-rs")], names  # watchfiles
    finally:
        engine.close(linger=0)
        context.term()
