"""Load reports from the engines (:mod:`infergate.wire.load`), as a data-layer feed.

An infergate engine with ``--completion-events-port`` pushes its load (queue, running,
KV usage, cache config, adapters, the prefill-cost counters) on the same PUB socket as
its completion records, when it changes and at least every heartbeat. The completion
subscription (:mod:`infergate.epp.datalayer.completions`) reads the reports lazily,
right before a decision (``Datastore.refresh``), and hands each engine's newest payload
here; older ones queued behind it are skipped. A snapshot is dated when the engine sent
its report (:func:`sent_on_our_clock`), not when it was read, so its age, its liveness
(:func:`push_alive`) and what it says of work in progress are as they would be had it
been read on arrival. Each report replaces the endpoint's
snapshot whole, exactly as a scrape does, so every plugin reads it unchanged; the
collector stops scraping an endpoint while its reports keep arriving
(:func:`push_alive`). When they stop (the engine died), the snapshot ages like a failed
scrape's and the endpoint goes stale after ``--metrics-staleness-threshold``; the
collector meanwhile falls back to scraping, which fails too for a dead engine.

A report is checked at decode (bounds in the wire format); a bad one is counted, logged
once per endpoint until a good one arrives, and dropped. Nothing here grows with the
number of reports: each replaces the previous snapshot.

A report equal to the endpoint's previous one but for its send time (an idle engine's
heartbeat) is not applied again: the snapshot stands and only gets newer (its
``updated_at``), as an unchanged scraped page does. Every replica receives
every engine's reports, so what one report costs is paid once per replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.types import EndpointState, Metrics
from msgspec.structs import astuple

from infergate.wire import load

log = logging.getLogger("infergate.epp.load_reports")

#: A pushing endpoint is not scraped while its last report is younger than this many
#: heartbeats (a lost report or two is not a dead engine).
PUSH_GRACE_HEARTBEATS = 2.5


def push_alive(metrics: Metrics, now: float) -> bool:
    """Whether ``metrics`` came from a push stream that is still reporting."""
    return metrics.pushed and now < push_deadline(metrics)


def push_deadline(metrics: Metrics) -> float:
    """When the push stream behind ``metrics`` counts as stopped, on the monotonic clock:
    a grace of heartbeats from when its report was sent (:func:`sent_on_our_clock`: a
    report read late, the engine dead meanwhile, does not count as a fresh one)."""
    return metrics.updated_at + PUSH_GRACE_HEARTBEATS * metrics.heartbeat


def snapshot(report: load.LoadReport, now: float, wall: float) -> Metrics:
    """The metrics snapshot a report stands for, received at ``now`` (monotonic)."""
    return Metrics(
        waiting=report.waiting,
        running=report.running,
        counts_reported=True,
        kv_usage=report.kv_usage,
        active_models=frozenset(report.running_adapters),
        waiting_models=frozenset(report.waiting_adapters),
        max_active_models=report.max_lora,
        block_size=report.block_size,
        num_gpu_blocks=report.num_gpu_blocks,
        prefill_seconds_sum=report.prefill_seconds_sum,
        prefill_count=report.prefill_count,
        prompt_tokens_total=report.prompt_tokens_total,
        prefix_hits_total=report.prefix_hits_total,
        prefix_queries_total=report.prefix_queries_total,
        prefill_pending_tokens=report.prefill_pending_tokens,
        prefill_waiting_tokens=report.prefill_waiting_tokens,
        updated_at=sent_on_our_clock(report, now, wall),
        tick=report.tick,
        heartbeat=report.heartbeat,
    )


def sent_on_our_clock(report: load.LoadReport, now: float, wall: float) -> float:
    """When ``report`` was sent, on the monotonic clock, read at ``now`` (``wall``).

    Reports are read at a decision, not as they arrive, so "when it was read" says
    nothing: an unchanged report read late would look newer than it is (its pending
    prefill not yet worked off, its stream alive after the engine died). The snapshot is
    dated when the engine sent it, and its ``lag`` is 0. Wall clocks of two hosts may
    disagree: the difference only counts within a heartbeat.
    """
    return now - min(max(0.0, wall - report.sent_at), report.heartbeat)


class LoadReports:
    """Applies load-report payloads to the datastore (``on_payload``)."""

    def __init__(
        self,
        datastore: Datastore,
        metrics: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.datastore = datastore
        self.metrics = metrics
        self.clock = clock
        self.received = 0
        self.rejected = 0
        self._bad: set[str] = set()  # endpoints whose last report was bad (log once)
        #: Per endpoint, its last applied report and the snapshot made from it.
        self._last: dict[str, tuple[load.LoadReport, Metrics]] = {}
        self.unchanged = 0

    def on_payload(self, endpoint_key: str, payload: bytes) -> None:
        state = self.datastore.get(endpoint_key)
        if state is None:
            return
        started = time.thread_time()
        try:
            report = load.decode(payload)
        except ValueError as error:
            self.rejected += 1
            if self.metrics is not None:
                self.metrics.datalayer_rejected.labels("push").inc()
            if endpoint_key not in self._bad and len(self._bad) < 10_000:
                self._bad.add(endpoint_key)
                log.warning("dropping load reports from %s: %s", endpoint_key, error)
            return
        self._bad.discard(endpoint_key)
        self.apply(state, report)
        if self.metrics is not None:
            self.metrics.datalayer_update("push", len(payload), time.thread_time() - started)

    def apply(self, state: EndpointState, report: load.LoadReport) -> None:
        now, wall = self.clock(), time.time()
        last = self._last.get(state.key)
        if last is not None and state.metrics is last[1] and _same_load(report, last[0]):
            # Only the send time differs: the same view, newer. The cost model's counters
            # are unchanged too, so observing them again would add nothing.
            metrics = last[1]
            metrics.updated_at = sent_on_our_clock(report, now, wall)
            self._last[state.key] = (report, metrics)
            self.received += 1
            self.unchanged += 1
            return
        metrics = snapshot(report, now, wall)
        self._last[state.key] = (report, metrics)
        state.metrics = metrics
        state.cost.observe_counters(
            metrics.prefill_seconds_sum,
            metrics.prefill_count,
            metrics.prompt_tokens_total,
            metrics.prefix_hits_total,
            metrics.prefix_queries_total,
            observed=(state.completed_prompt_tokens, state.completed_cached_tokens),
        )
        self.received += 1

    def forget(self, endpoint_key: str) -> None:
        """The endpoint left the pool."""
        self._bad.discard(endpoint_key)
        self._last.pop(endpoint_key, None)


def _same_load(a: load.LoadReport, b: load.LoadReport) -> bool:
    """Whether two reports say the same but for ``sent_at`` (the first field)."""
    return astuple(a)[1:] == astuple(b)[1:]
