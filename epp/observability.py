"""The EPP's own Prometheus metrics (one registry per EPP, served on ``--metrics-port``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from infergate.epp.datalayer.datastore import Datastore
    from infergate.epp.flowcontrol.saturation import SaturationDetector
    from infergate.epp.scheduling.plugins.base import Plugin

LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5,
)  # fmt: skip
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class _EndpointGauges(Collector):
    """Per-endpoint gauges read from the datastore at scrape time (no per-update cost)."""

    def __init__(self, datastore: Datastore, saturation: SaturationDetector) -> None:
        self.datastore = datastore
        self.saturation = saturation

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.monotonic()
        queue = GaugeMetricFamily(
            "infergate_epp_endpoint_queue_size",
            "Waiting requests per endpoint.",
            labels=["endpoint"],
        )
        running = GaugeMetricFamily(
            "infergate_epp_endpoint_running_requests",
            "Running requests per endpoint.",
            labels=["endpoint"],
        )
        kv = GaugeMetricFamily(
            "infergate_epp_endpoint_kv_cache_usage",
            "KV-cache usage (0-1) per endpoint.",
            labels=["endpoint"],
        )
        in_flight = GaugeMetricFamily(
            "infergate_epp_endpoint_in_flight_requests",
            "Requests the EPP routed there that have not completed.",
            labels=["endpoint"],
        )
        stale = GaugeMetricFamily(
            "infergate_epp_endpoint_metrics_stale",
            "1 when the endpoint's metrics are stale.",
            labels=["endpoint"],
        )
        for state in self.datastore.all():
            key = state.key
            queue.add_metric([key], state.metrics.waiting)
            running.add_metric([key], state.metrics.running)
            kv.add_metric([key], state.metrics.kv_usage)
            in_flight.add_metric([key], state.in_flight_requests)
            stale.add_metric([key], 1.0 if self.saturation.is_stale(state, now) else 0.0)
        ready = GaugeMetricFamily("infergate_epp_pool_endpoints", "Endpoints in the pool.")
        ready.add_metric([], len(self.datastore))
        yield from (queue, running, kv, in_flight, stale, ready)


class EppMetrics:
    def __init__(self, datastore: Datastore, saturation: SaturationDetector) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "infergate_epp_requests",
            "Requests handled, by outcome (routed, shed_429, no_endpoint_503, bad_request_400, "
            "too_large_413, error).",
            ["outcome"],
            registry=r,
        )
        self.scheduling_latency = Histogram(
            "infergate_epp_scheduling_duration_seconds",
            "Time from end of request body to the routing decision.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.plugin_latency = Histogram(
            "infergate_epp_plugin_duration_seconds",
            "Time spent in each plugin per extension point.",
            ["plugin_type", "plugin_name", "extension_point"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_hit_ratio = Histogram(
            "infergate_epp_prefix_indexer_hit_ratio",
            "Fraction of a request's prefix blocks cached on the chosen endpoint.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "infergate_epp_tokens", "Tokens reported in responses' usage.", ["kind"], registry=r
        )
        self.scrape_errors = Counter(
            "infergate_epp_scrape_errors",
            "Failed metric scrapes, by endpoint.",
            ["endpoint"],
            registry=r,
        )
        self.kv_events = Counter(
            "infergate_epp_kv_events", "KV-cache events received, by type.", ["type"], registry=r
        )
        r.register(_EndpointGauges(datastore, saturation))
        self._plugin_children: dict[tuple[int, str], Histogram] = {}

    def plugin_timer(self, plugin: Plugin, point: str, seconds: float) -> None:
        key = (id(plugin), point)
        child = self._plugin_children.get(key)
        if child is None:
            child = self.plugin_latency.labels(plugin.type_name, plugin.name, point)
            self._plugin_children[key] = child
        child.observe(seconds)
