"""Keep ``infergate up``'s engines and EPP replicas running: a dead one is reported and
restarted.

An engine dying is an ordinary event in a fleet: the EPP stops picking it when its
metrics go stale and Envoy retries the next endpoint of the pick, so the rest of the
stack keeps serving while it comes back. An EPP replica dying is one too, a lone EPP
included: a response already routed does not depend on the EPP (Envoy streams it from
the engine; tests/e2e/test_epp_death.py), so the streams in flight complete. Until it
is back, new requests go to another replica, or with a lone EPP get FailClose's 500
(FailOpen: Envoy's fallback endpoints). Only Envoy dying stops the stack: without it
nothing is served. Restarts back off (1 s doubling to 30 s) so a crash loop cannot
spin, and an EPP that cannot start again stops the stack, saying why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infergate.procs import ManagedProcess
    from infergate.stack.local import LocalStack

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0
"""A process that stayed up this long has its backoff reset."""


@dataclass
class _Backoff:
    """One supervised process's restart bookkeeping."""

    started: float
    delay: float = FIRST_BACKOFF_S
    not_before: float = 0.0
    restarts: int = 0

    def due(self, alive: bool, now: float) -> bool:
        """Whether to restart now: dead, and its backoff has passed."""
        if alive:
            if now - self.started > HEALTHY_AFTER_S:
                self.delay = FIRST_BACKOFF_S
            return False
        return now >= self.not_before

    def restarted(self, now: float) -> None:
        self.restarts += 1
        self.started = now
        self.not_before = now + self.delay
        self.delay = min(MAX_BACKOFF_S, self.delay * 2)


def _exit_report(process: ManagedProcess, what: str) -> str:
    code = process.popen.returncode if process.popen else None
    return (
        f"{what}\n--- last lines of {process.log_path} (exit code {code}) ---\n"
        f"{process.log_tail(2000)}"
    )


class _Supervisor:
    """What both supervisors keep: the stack, where reports go, and a backoff for each
    process of the kind they watch (``_watched``)."""

    def __init__(
        self,
        stack: LocalStack,
        report: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.report = report
        self.clock = clock
        self._backoff = [_Backoff(clock()) for _ in self._watched()]

    def _watched(self) -> Sequence[object]:
        raise NotImplementedError

    @property
    def restarts(self) -> list[int]:
        return [backoff.restarts for backoff in self._backoff]


class EngineSupervisor(_Supervisor):
    """Restarts dead engines (``check``, non-blocking)."""

    def _watched(self) -> Sequence[object]:
        return self.stack.engines

    def check(self) -> None:
        """Restart every dead engine whose backoff has passed (non-blocking)."""
        now = self.clock()
        ports = self.stack.spec.resolved_engine_ports()
        for index, process in enumerate(self.stack.engines):
            backoff = self._backoff[index]
            if not backoff.due(process.alive(), now):
                continue
            self.report(
                _exit_report(
                    process, f"{process.name} exited; restarting it, the rest keeps serving."
                )
            )
            if process in self.stack.group.processes:
                self.stack.group.processes.remove(process)
            self.stack.engines[index] = self.stack._start_engine(index, ports[index])
            backoff.restarted(now)


class EppSupervisor(_Supervisor):
    """Restarts dead EPP replicas, a lone EPP as well as one of several (``check``).

    A restart waits until the EPP serves (seconds); one that cannot start raises
    :class:`~infergate.stack.local.StackError`.
    """

    def _watched(self) -> Sequence[object]:
        return self.stack.epps

    def check(self) -> None:
        """Restart every dead replica whose backoff has passed."""
        now = self.clock()
        for index, process in enumerate(self.stack.epps):
            backoff = self._backoff[index]
            if process is None or not backoff.due(process.alive(), now):
                continue
            self.report(_exit_report(process, self._meanwhile(index)))
            self.stack.stop_epp(index)
            self.stack.start_epp(index)
            backoff.restarted(now)

    def _meanwhile(self, index: int) -> str:
        """What the stack does while replica ``index`` comes back."""
        replicas = self.stack.epps
        name = f"EPP replica {index}" if len(replicas) > 1 else "The EPP"
        if any(p is not None and p.alive() for i, p in enumerate(replicas) if i != index):
            meanwhile = "the other replicas route new requests"
        elif self.stack.spec.failure_mode_allow:
            meanwhile = "new requests go to Envoy's fallback endpoints (FailOpen)"
        else:
            meanwhile = "new requests get 500 (FailClose)"
        return (
            f"{name} exited; restarting it. Responses in flight complete; until it is "
            f"back, {meanwhile}."
        )
