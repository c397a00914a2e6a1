"""The data layer: one scrape loop per endpoint, every ``interval`` seconds.

All loops share one aiohttp session (keep-alive connections, one per endpoint). A failed
scrape keeps the previous snapshot, which ages into staleness — and stale means
saturated — so a dead engine drops out of scheduling without a special case.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.dialects import dialect_for, parse_metrics
from infergate.epp.datalayer.endpoint_tasks import EndpointTasks
from infergate.epp.observability import EppMetrics
from infergate.epp.types import Endpoint

log = logging.getLogger("infergate.epp.datalayer.collector")


class Collectors:
    def __init__(
        self,
        datastore: Datastore,
        interval: float = 0.05,
        timeout: float = 1.0,
        metrics: EppMetrics | None = None,
        path: str = "/metrics",
    ) -> None:
        self.datastore = datastore
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.metrics = metrics
        self.path = path
        self._tasks = EndpointTasks(datastore, self._loop, "collector")
        self._session: aiohttp.ClientSession | None = None
        self.scrapes = 0
        self.failures = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=2, keepalive_timeout=30),
            timeout=self.timeout,
            auto_decompress=True,
        )
        self._tasks.start()

    async def _loop(self, endpoint: Endpoint) -> None:
        assert self._session is not None
        url = f"http://{endpoint.key}{self.path}"
        dialect = dialect_for(endpoint)
        failing = False
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                async with self._session.get(url) as response:
                    if response.status != 200:
                        raise ValueError(f"HTTP {response.status}")
                    text = await response.read()
                snapshot = parse_metrics(text, dialect)
                state = self.datastore.get(endpoint.key)
                if state is not None:
                    state.metrics = snapshot
                    state.cost.observe_counters(
                        snapshot.prefill_seconds_sum,
                        snapshot.prefill_count,
                        snapshot.prompt_tokens_total,
                        snapshot.prefix_hits_total,
                        snapshot.prefix_queries_total,
                        observed=(state.completed_prompt_tokens, state.completed_cached_tokens),
                    )
                self.scrapes += 1
                if failing:
                    log.info("metrics from %s are back", endpoint.key)
                    failing = False
            except asyncio.CancelledError:
                raise
            except Exception as error:  # network, HTTP, parse: keep the old snapshot
                self.failures += 1
                if self.metrics is not None:
                    self.metrics.scrape_errors.labels(endpoint.key).inc()
                if not failing:
                    log.warning("scraping %s failed: %s", url, error or type(error).__name__)
                    failing = True
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def stop(self) -> None:
        await self._tasks.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
