"""The engine's side of load reports (:mod:`infergate.wire.load`): push, don't be scraped.

A background thread samples the engine's load every ``tick`` seconds (the same live
values ``/metrics`` renders, via :meth:`EngineMetrics.load_state`) and hands a report to
the completion publisher, which owns the PUB socket, when the state changed or when
``heartbeat`` seconds passed without a report. Several changes within one tick go out as
one report (coalesced); an idle engine sends one report per heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from infergate.wire.load import LoadReport

log = logging.getLogger(__name__)

#: Defaults: a change reaches the EPP within ~10 ms; an idle engine costs the EPP two
#: small decodes a second. The heartbeat must stay well under the EPP's staleness
#: threshold (2 s by default), or a live idle engine would read as stale.
DEFAULT_TICK = 0.01
DEFAULT_HEARTBEAT = 0.5


class LoadReporter:
    """Samples ``state()`` every ``tick``; calls ``send(report)`` on change or heartbeat."""

    def __init__(
        self,
        state: Callable[[], tuple[object, ...]],
        send: Callable[[LoadReport], None],
        *,
        tick: float = DEFAULT_TICK,
        heartbeat: float = DEFAULT_HEARTBEAT,
    ) -> None:
        if not 0 < tick <= heartbeat:
            raise ValueError(f"load report tick {tick} must be > 0 and <= heartbeat {heartbeat}")
        self.state = state
        self.send = send
        self.tick = tick
        self.heartbeat = heartbeat
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-reports", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        last: tuple[object, ...] | None = None
        last_sent = 0.0
        while not self._stop.wait(self.tick):
            try:
                state = self.state()
            except RuntimeError:  # a set changed size while read from the step thread
                continue
            now = time.monotonic()
            if state == last and now - last_sent < self.heartbeat:
                continue
            try:
                self.send(LoadReport(time.time(), self.tick, self.heartbeat, *state))  # type: ignore[arg-type]
            except Exception:  # reporting must never take the engine down
                log.exception("failed to queue a load report")
                continue
            last, last_sent = state, now
            self.sent += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
