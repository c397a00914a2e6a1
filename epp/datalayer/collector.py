"""The data layer: one scrape loop per endpoint, every ``interval`` seconds.

Each loop keeps one keep-alive connection to its endpoint (:mod:`.http_get`: an asyncio
protocol and httptools' parser; aiohttp's client cost more CPU per request than the rest
of a scrape together), and asks only for the samples its dialect reads
(:meth:`~infergate.epp.datalayer.dialects.Dialect.query`): ~1.6 KB rather than the ~30 KB
page, so the engine renders, and the EPP receives and scans, a twentieth of it. Each loop
starts at a random phase of the interval, so a pool's scrapes are spread over it rather
than fired together, and then keeps a fixed rate. A page equal to
the endpoint's previous one (an idle engine) is not parsed again: the snapshot only gets
newer. A failed scrape keeps the previous snapshot, which ages into staleness — and stale
means saturated — so a dead engine drops out of scheduling without a special case.

An endpoint that pushes load reports (:mod:`infergate.epp.datalayer.load_reports`) is
not scraped while its reports keep arriving; when they stop, scraping resumes. One
watch checks every pushing endpoint (:class:`_PushWatch`) from the earliest deadline
among them; reports are read lazily (``Datastore.refresh``), so it reads what came first.
These checks (about one per heartbeat grace, whatever the pool's size) ride on the
refreshes of decisions and of Envoy's health checks, with a timer as a backstop; in a
pool that makes no decisions they keep the snapshots and the feeds' queues current.

An endpoint known dead — its metrics port refuses the connection, or its snapshot is
older than the staleness threshold while scrapes fail — is reported to ``on_dead`` on
each failed scrape (every ``interval``): the EPP then stops waiting for the completion
records of the requests it sent there, which releases their in-flight counts at once
rather than when the records' deadline passes (a SIGKILLed engine sends none).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.dialects import dialect_for, parse_metrics
from infergate.epp.datalayer.endpoint_tasks import EndpointTasks
from infergate.epp.datalayer.http_get import KeepAliveGet
from infergate.epp.datalayer.load_reports import push_alive, push_deadline
from infergate.epp.observability import EppMetrics
from infergate.epp.types import Endpoint, Metrics

log = logging.getLogger("infergate.epp.datalayer.collector")


#: How early a decision's refresh may do a timer's work in its place (it then needs no
#: wakeup): the push watch's check, and the lost-record sweep (``server/record_sweep.py``).
PIGGYBACK_S = 0.5
#: How long after the earliest push deadline the push watch's own timer fires. Until then
#: a refresh does the check in its place: a decision's, or the one a health check makes
#: (:meth:`Collectors.housekeep`). The window ``[deadline - PIGGYBACK_S, deadline +
#: BACKSTOP_S]`` is 1 s wide, so a lone EPP's health checks (every second) fall in each.
#: With the engines' default 0.5 s heartbeat the check still comes before a report is
#: stale: 2.5 heartbeats of grace + 0.5 s = 1.75 s, under the 2 s staleness threshold.
BACKSTOP_S = 0.5


class Collectors:
    def __init__(
        self,
        datastore: Datastore,
        interval: float = 0.05,
        timeout: float = 1.0,
        metrics: EppMetrics | None = None,
        path: str = "/metrics",
        on_dead: Callable[[str], None] | None = None,
        staleness: float = 2.0,
    ) -> None:
        self.datastore = datastore
        self.interval = interval
        self.timeout = timeout
        self.metrics = metrics
        self.path = path
        #: Called with an endpoint's key on each failed scrape of an endpoint known dead
        #: (:meth:`_Scraper.dead`); ``staleness`` is the snapshot age that counts as dead.
        self.on_dead = on_dead
        self.staleness = staleness
        self._tasks = EndpointTasks(datastore, self._loop, "collector")
        self._pushes = _PushWatch(datastore, interval)
        if metrics is not None:  # a departed endpoint's series go with it (bounded memory)
            self._tasks.removed_listeners.append(lambda e: metrics.forget_endpoint(e.key))
        self.scrapes = 0
        self.failures = 0

    async def start(self) -> None:
        self._tasks.start()

    async def _loop(self, endpoint: Endpoint) -> None:
        loop = asyncio.get_running_loop()
        # A random phase spreads the pool's scrapes over the interval instead of firing
        # them all at once; after that each endpoint keeps a fixed rate.
        due = loop.time() + random.uniform(0.0, self.interval)
        scraper = _Scraper(self, endpoint)
        try:
            await self._run(endpoint, scraper, due)
        finally:
            scraper.http.close()

    async def _run(self, endpoint: Endpoint, scraper: _Scraper, due: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            self.datastore.refresh()  # pushed reports are read lazily: read what came
            state = self.datastore.get(endpoint.key)
            now = time.monotonic()  # the snapshots' clock (uvloop's loop.time() is its own)
            if state is not None and push_alive(state.metrics, now):
                # The engine pushes its load: no scrape until its reports stop.
                await self._pushes.stopped(endpoint.key)
                due = loop.time()
                continue
            await scraper.scrape()
            due += self.interval
            if due < loop.time():  # fell behind (a slow scrape, a busy loop): skip, don't burst
                due = loop.time() + random.uniform(0.0, self.interval)

    def housekeep(self) -> None:
        """Called at a wakeup the EPP has anyway (Envoy's health check):
        refresh the datastore if the push watch's check is due, so it runs here rather
        than on a wakeup of its own (a refresh also does the lost-record sweep when that
        is near). Each wakeup spared is ~0.35 ms of CPU on a shared core, and every
        replica paid one a second (docs/benchmarks/scale.md, "Replicas")."""
        if self._pushes.due(time.monotonic()):
            self.datastore.refresh()

    async def stop(self) -> None:
        await self._tasks.stop()
        self._pushes.close()


class _PushWatch:
    """One timer for every endpoint that pushes, rather than one per endpoint.

    A pushing endpoint's scrape loop waits in :meth:`stopped` until its reports stop.
    The watch checks from the earliest deadline among them (:func:`push_deadline`): it
    reads what the feeds hold (``Datastore.refresh``: reports are read lazily) and
    releases the endpoints whose pushes stopped; the rest wait on, to their new
    deadlines. A pool of N heartbeating engines costs about one check per heartbeat
    grace, not N, and every replica pays these checks whether it routes or not.

    So the check rides on refreshes the replica makes anyway: any refresh from
    :data:`PIGGYBACK_S` before the deadline does it (a decision's, or the health check's,
    :meth:`Collectors.housekeep`), since it has just read the feeds. The watch's own
    timer is a backstop, :data:`BACKSTOP_S` after the deadline, for a replica that
    neither decides nor is health-checked then: a stopped push is found up to that much
    later, a wakeup a second is spared (a routing replica was woken for the watch on 4-14
    of the ~15 deadlines of a 15 s row, docs/benchmarks/scale.md, "Replicas").
    """

    def __init__(self, datastore: Datastore, interval: float) -> None:
        self.datastore = datastore
        self.interval = interval  # the closest two checks may be
        self.checks = 0
        #: Checks a refresh did, a decision's or a health check's (no wakeup of their own).
        self.piggybacked = 0
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the timer fires, on the monotonic clock
        self._deadline = 0.0  # the earliest push deadline at the last arming
        self._checking = False
        datastore.on_refresh(self._on_refresh)

    async def stopped(self, key: str) -> None:
        """Return once ``key``'s pushes have stopped (or it left the pool)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[key] = waiter
        self._arm()
        try:
            await waiter
        finally:
            if self._waiting.get(key) is waiter:
                del self._waiting[key]

    def _arm(self) -> None:
        deadlines = [
            push_deadline(state.metrics)
            for key in self._waiting
            if (state := self.datastore.get(key)) is not None
        ]
        now = time.monotonic()
        self._deadline = min(deadlines, default=now)
        due = max(self._deadline + BACKSTOP_S, now + self.interval)
        if self._timer is not None and self._due <= due:
            return  # it fires soon enough
        if self._timer is not None:
            self._timer.cancel()
        self._due = due
        self._timer = asyncio.get_running_loop().call_later(due - now, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def due(self, now: float) -> bool:
        """Whether a refresh now does the check: one is waited for, and it is at most
        :data:`PIGGYBACK_S` before the earliest deadline."""
        return (
            self._timer is not None and not self._checking and now >= self._deadline - PIGGYBACK_S
        )

    def _on_refresh(self) -> None:
        """After the feeds were read (a decision, a health check): check now if due."""
        if self._timer is None or not self.due(time.monotonic()):
            return
        self._timer.cancel()
        self.piggybacked += 1
        self._check(refresh=False)

    def _check(self, refresh: bool = True) -> None:
        self._timer = None
        self.checks += 1
        if refresh:
            self._checking = True  # its own refresh must not check again
            try:
                self.datastore.refresh()
            finally:
                self._checking = False
        now = time.monotonic()
        for key, waiter in list(self._waiting.items()):
            state = self.datastore.get(key)
            if state is None or not push_alive(state.metrics, now):
                del self._waiting[key]
                if not waiter.done():
                    waiter.set_result(None)
        if self._waiting:
            self._arm()


class _Scraper:
    """One endpoint's scrape: fetch, parse (or reuse an unchanged page), apply."""

    def __init__(self, collectors: Collectors, endpoint: Endpoint) -> None:
        self.c = collectors
        self.endpoint = endpoint
        self.dialect = dialect_for(endpoint)
        # Only the samples the dialect reads (a server that ignores the query sends all).
        separator = "&" if "?" in collectors.path else "?"
        path = f"{collectors.path}{separator}{self.dialect.query()}"
        self.url = f"http://{endpoint.key}{path}"
        self.http = KeepAliveGet(endpoint.address, endpoint.port, path, collectors.timeout)
        self.failing = False
        self.last_page = b""
        self.last: Metrics | None = None

    async def scrape(self) -> None:
        c = self.c
        try:
            status, text = await self.http.get()
            if status != 200:
                raise ValueError(f"HTTP {status}")
            started = time.thread_time()
            parsed = self._apply(text)
            if c.metrics is not None:
                source = "scrape" if parsed else "scrape_unchanged"
                c.metrics.datalayer_update(source, len(text), time.thread_time() - started)
            c.scrapes += 1
            if self.failing:
                log.info("metrics from %s are back", self.endpoint.key)
                self.failing = False
        except asyncio.CancelledError:
            raise
        except Exception as error:  # network, HTTP, parse: keep the old snapshot
            c.failures += 1
            if c.metrics is not None:
                c.metrics.scrape_errors.labels(self.endpoint.key).inc()
            if not self.failing:
                log.warning("scraping %s failed: %s", self.url, error or type(error).__name__)
                self.failing = True
            if c.on_dead is not None and self.dead(error):
                c.on_dead(self.endpoint.key)

    def dead(self, error: Exception) -> bool:
        """Whether a failed scrape shows the endpoint dead: its port refuses connections
        (the engine's process is gone), or its last snapshot, pushed or scraped, is older
        than the staleness threshold (a host that no longer answers at all). A timeout
        or a dropped keep-alive alone is not enough: a busy engine is still serving."""
        if isinstance(error, ConnectionRefusedError):
            return True
        state = self.c.datastore.get(self.endpoint.key)
        return state is not None and state.metrics.age() > self.c.staleness

    def _apply(self, text: bytes) -> bool:
        """Apply a page; False when it was the previous page again (nothing parsed)."""
        state = self.c.datastore.get(self.endpoint.key)
        if state is None:
            return False
        now = time.monotonic()
        if self.last is not None and state.metrics is self.last and text == self.last_page:
            # Same page as last time (an idle engine): the snapshot stands, only newer.
            self.last.updated_at = now
            return False
        snapshot = parse_metrics(text, self.dialect)
        self.last_page, self.last = text, snapshot
        state.metrics = snapshot
        state.cost.observe_counters(
            snapshot.prefill_seconds_sum,
            snapshot.prefill_count,
            snapshot.prompt_tokens_total,
            snapshot.prefix_hits_total,
            snapshot.prefix_queries_total,
            observed=(state.completed_prompt_tokens, state.completed_cached_tokens),
        )
        return True
