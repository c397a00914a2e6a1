"""Start, watch and always stop real child processes (engines, EPP, Envoy).

Shared by ``infergate up`` and the test harness, so both get the same guarantees:
readiness is awaited with a deadline, an early exit is reported with the log's tail,
and every child is stopped — on normal exit, on Ctrl-C, and (via PR_SET_PDEATHSIG)
even when the parent is killed outright.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ReadyCheck = Callable[[], bool]

_LIVE: set[ManagedProcess] = set()
_PR_SET_PDEATHSIG = 1


class ProcessStartError(RuntimeError):
    """A child exited or never became ready; the message carries its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` free TCP ports on ``host``, all different: held open together while asked
    for, since one :func:`free_port` call at a time may be handed the same port twice."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tcp_ready(host: str, port: int) -> ReadyCheck:
    """Ready once something accepts TCP connections on host:port."""

    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    return check


def http_ready(url: str, expect_status: int = 200) -> ReadyCheck:
    """Ready once GET ``url`` answers ``expect_status``."""

    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return bool(response.status == expect_status)
        except urllib.error.HTTPError as error:
            return error.code == expect_status
        except (OSError, ValueError):
            return False

    return check


def _load_prctl() -> Any:
    """libc's ``prctl``, resolved once in the parent: loading a library (``dlopen``,
    which takes the allocator's locks) in a child forked from a process with threads (a
    gRPC server, say) can deadlock or crash it before it reaches ``exec``."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform == "linux" else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Ask Linux to SIGTERM this child if the parent dies, so nothing is left behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(eq=False)
class ManagedProcess:
    """One child process in its own process group, logging to a file."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    log_path: Path | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"infergate-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, "process not started"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace")
        return text[-max_chars:]

    def wait_ready(self, check: ReadyCheck, timeout: float = 30.0, interval: float = 0.05) -> None:
        """Poll ``check`` until it passes; fail fast, with the log, if the child exits."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                code = self.popen.returncode if self.popen else None
                raise ProcessStartError(
                    f"{self.name} exited with code {code} before it was ready.\n"
                    f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
                )
            if check():
                return
            if time.monotonic() > deadline:
                raise ProcessStartError(
                    f"{self.name} was not ready after {timeout:.0f}s.\n"
                    f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
                )
            time.sleep(interval)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the whole group, then SIGKILL after ``grace`` seconds."""
        _LIVE.discard(self)
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(timeout=grace)
        # Reap anything the child left in its group (e.g. a shell's grandchildren).
        self._signal_group(signal.SIGKILL)
        return self.popen.returncode

    def _signal_group(self, sig: int) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


class ProcessGroup:
    """Processes started together and stopped together, in reverse order."""

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready: ReadyCheck | None = None,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log_path: Path | None = None,
    ) -> ManagedProcess:
        process = ManagedProcess(name, argv, env=env, cwd=cwd, log_path=log_path)
        self.processes.append(process)
        process.start()
        if ready is not None:
            process.wait_ready(ready, timeout=timeout)
        return process

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def __iter__(self) -> Iterator[ManagedProcess]:
        return iter(self.processes)


@atexit.register
def _stop_leftovers() -> None:
    for process in list(_LIVE):
        process.stop(grace=2.0)
