"""Keep ``infergate up``'s engines running: a dead engine is reported and restarted.

Only the engines are supervised. An engine dying is an ordinary event in a fleet (the EPP
stops picking it when its metrics go stale and Envoy retries the next endpoint of the
pick), so the rest of the stack keeps serving while it comes back. The EPP or Envoy
dying stops the stack instead: without them nothing is served, and a silent restart
would hide the bug. Restarts back off (1 s doubling to 30 s) so a crash loop cannot spin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infergate.stack.local import LocalStack

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0
"""An engine that stayed up this long has its backoff reset."""


class EngineSupervisor:
    def __init__(
        self,
        stack: LocalStack,
        report: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.report = report
        self.clock = clock
        self.restarts = [0] * len(stack.engines)
        self._backoff = [FIRST_BACKOFF_S] * len(stack.engines)
        self._not_before = [0.0] * len(stack.engines)
        self._started = [clock()] * len(stack.engines)

    def check(self) -> None:
        """Restart every dead engine whose backoff has passed (non-blocking)."""
        now = self.clock()
        ports = self.stack.spec.resolved_engine_ports()
        for index, process in enumerate(self.stack.engines):
            if process.alive():
                if now - self._started[index] > HEALTHY_AFTER_S:
                    self._backoff[index] = FIRST_BACKOFF_S
                continue
            if now < self._not_before[index]:
                continue
            code = process.popen.returncode if process.popen else None
            self.report(
                f"{process.name} exited (code {code}); restarting it, the rest keeps serving.\n"
                f"--- last lines of {process.log_path} ---\n{process.log_tail(2000)}"
            )
            if process in self.stack.group.processes:
                self.stack.group.processes.remove(process)
            self.stack.engines[index] = self.stack._start_engine(index, ports[index])
            self.restarts[index] += 1
            self._started[index] = now
            self._not_before[index] = now + self._backoff[index]
            self._backoff[index] = min(MAX_BACKOFF_S, self._backoff[index] * 2)
