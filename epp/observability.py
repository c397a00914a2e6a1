"""The EPP's own Prometheus metrics (one registry per EPP, served on ``--metrics-port``).

Every part of the EPP reports here (the data layer's collectors included), so this module
sits below them all: what it reads of the datastore, the saturation detector and the
plugins it names by the small protocols below, not by importing those parts.

Histograms are :class:`~infergate.epp.loop_histogram.LoopHistogram`: every one is
observed from the event loop's thread, on the request path, where prometheus-client's
locks and bucket scan cost a tenth of a request's CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from infergate.epp.loop_histogram import HistogramChild, LoopHistogram
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from infergate.epp.types import EndpointState


class Endpoints(Protocol):
    """The datastore, as the per-endpoint gauges read it."""

    def all(self) -> Sequence[EndpointState]: ...


class Staleness(Protocol):
    """The saturation detector's view of whether an endpoint's metrics are too old."""

    def is_stale(self, state: EndpointState, now: float | None = None) -> bool: ...


class Named(Protocol):
    """A plugin, as the per-plugin latency histogram labels it."""

    @property
    def type_name(self) -> str: ...

    @property
    def name(self) -> str: ...


LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5,
)  # fmt: skip
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
GIE_DURATION_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
    30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
GIE_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
    262144, 524288, 1048576,
)  # fmt: skip
#: Ages of load data: from a push's few milliseconds to the 2 s staleness threshold.
AGE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
GIE_BYTES_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class _EndpointGauges(Collector):
    """Per-endpoint gauges read from the datastore at scrape time (no per-update cost)."""

    def __init__(self, datastore: Endpoints, saturation: Staleness, pool_name: str = "") -> None:
        self.datastore = datastore
        self.saturation = saturation
        self.pool_name = pool_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.monotonic()
        states = self.datastore.all()
        for name, doc, value in self._per_endpoint(now):
            family = GaugeMetricFamily(name, doc, labels=["endpoint"])
            for state in states:
                family.add_metric([state.key], value(state))
            yield family
        ready = GaugeMetricFamily("infergate_epp_pool_endpoints", "Endpoints in the pool.")
        ready.add_metric([], len(states))
        yield ready
        yield from self._gie_pool_gauges()

    def _per_endpoint(self, now: float) -> list[tuple[str, str, Callable[[EndpointState], float]]]:
        """(name, help, value) of every per-endpoint gauge."""
        stale = self.saturation.is_stale
        return [
            ("infergate_epp_endpoint_queue_size", "Waiting requests per endpoint.",
             lambda s: s.metrics.waiting),
            ("infergate_epp_endpoint_running_requests", "Running requests per endpoint.",
             lambda s: s.metrics.running),
            ("infergate_epp_endpoint_kv_cache_usage", "KV-cache usage (0-1) per endpoint.",
             lambda s: s.metrics.kv_usage),
            ("infergate_epp_endpoint_in_flight_requests",
             "Requests the EPP routed there that have not completed.",
             lambda s: s.in_flight_requests),
            ("infergate_epp_endpoint_metrics_stale", "1 when the endpoint's metrics are stale.",
             lambda s: 1.0 if stale(s, now) else 0.0),
            ("infergate_epp_endpoint_prefill_base_seconds",
             "Learned prefill cost per request (the fit's intercept), per endpoint.",
             lambda s: s.cost.base),
            ("infergate_epp_endpoint_prefill_seconds_per_token",
             "Learned prefill cost per uncached prompt token, per endpoint.",
             lambda s: s.cost.per_token),
            ("infergate_epp_endpoint_predicted_prefill_backlog_seconds",
             "Prefill work routed there that the EPP predicts is not done yet.",
             lambda s: max(0.0, s.prefill_busy_until - now)),
        ]  # fmt: skip

    def _gie_pool_gauges(self) -> Iterator[GaugeMetricFamily]:
        """GIE's ``inference_pool_*`` gauges (same names and labels), so its dashboards work."""
        states = self.datastore.all()
        pool = [self.pool_name]
        avg_kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "The average kv cache utilization for an inference server pool.",
            labels=["name"],
        )
        avg_queue = GaugeMetricFamily(
            "inference_pool_average_queue_size",
            "The average number of requests pending in the model server queue.",
            labels=["name"],
        )
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "The total number of requests pending in the model server queue for each pod.",
            labels=["name", "model_server_pod"],
        )
        ready = GaugeMetricFamily(
            "inference_pool_ready_pods", "The number of ready pods in the pool.", labels=["name"]
        )
        n = len(states)
        avg_kv.add_metric(pool, sum(s.metrics.kv_usage for s in states) / n if n else 0.0)
        avg_queue.add_metric(pool, sum(s.metrics.waiting for s in states) / n if n else 0.0)
        for state in states:
            per_pod.add_metric([self.pool_name, state.key], state.metrics.waiting)
        ready.add_metric(pool, n)
        yield from (avg_kv, avg_queue, per_pod, ready)


class _GieChildren(NamedTuple):
    """GIE's per-(model, target) series (``inference_objective_*``)."""

    requests: Counter
    running: Gauge
    duration: HistogramChild
    input_tokens: HistogramChild
    output_tokens: HistogramChild


class EppMetrics:
    def __init__(
        self, datastore: Endpoints, saturation: Staleness, pool_name: str = "local"
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._init_prefix_prediction(r)
        self._init_routing_outcomes(r)
        self._init_gie(r)
        self.requests = Counter(
            "infergate_epp_requests",
            "Requests handled, by outcome (routed, shed_429, no_endpoint_503, bad_request_400, "
            "too_large_413, error).",
            ["outcome"],
            registry=r,
        )
        self.scheduling_latency = LoopHistogram(
            "infergate_epp_scheduling_duration_seconds",
            "Time from end of request body to the routing decision.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.plugin_latency = LoopHistogram(
            "infergate_epp_plugin_duration_seconds",
            "Time spent in each plugin per extension point.",
            ["plugin_type", "plugin_name", "extension_point"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefix_hit_ratio = LoopHistogram(
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
        self.tokenize_errors = Counter(
            "infergate_epp_tokenize_errors",
            "Failed POST /tokenize calls to engines (precise prefix), by reason: unauthorized "
            "(401/403: the engines' API key), http_error, timeout, error, bad_response.",
            ["reason"],
            registry=r,
        )
        self.kv_event_gaps = Counter(
            "infergate_epp_kv_events_gaps",
            "Sequence gaps in an engine's KV events, by result: filled from the engine's "
            "replay socket, or dropped (the endpoint's precise-prefix entries cleared).",
            ["result"],
            registry=r,
        )
        self.kv_events_replayed = Counter(
            "infergate_epp_kv_events_replayed_batches",
            "KV event batches applied from engines' replay sockets.",
            registry=r,
        )
        self._init_datalayer(r)
        r.register(_EndpointGauges(datastore, saturation, pool_name))
        self._plugin_children: dict[tuple[int, str], HistogramChild] = {}

    # -- the data layer's freshness and cost (issue 21) -----------------------------------
    def _init_datalayer(self, r: CollectorRegistry) -> None:
        self.pick_metrics_age = LoopHistogram(
            "infergate_epp_pick_metrics_age_seconds",
            "Per routing decision: how old the picked endpoint's load data may be (a scrape: "
            "its age; a live push stream: the engine's sampling tick plus delivery lag).",
            ["source"],
            buckets=AGE_BUCKETS,
            registry=r,
        )
        self._age_children = {
            source: self.pick_metrics_age.labels(source) for source in ("push", "scrape")
        }
        self.datalayer_updates = Counter(
            "infergate_epp_datalayer_updates",
            "Load updates taken in: push (a load report), scrape (a parsed page), "
            "scrape_unchanged (a page equal to the endpoint's previous one, not parsed).",
            ["source"],
            registry=r,
        )
        self.datalayer_bytes = Counter(
            "infergate_epp_datalayer_bytes",
            "Bytes of load updates taken in, by source.",
            ["source"],
            registry=r,
        )
        self.datalayer_cpu = Counter(
            "infergate_epp_datalayer_cpu_seconds",
            "CPU spent decoding, parsing and applying load updates, by source (not the "
            "sockets' and event loop's share). Divided by the endpoints of that source, its "
            "rate is the per-endpoint cost of the data layer.",
            ["source"],
            registry=r,
        )
        self.datalayer_rejected = Counter(
            "infergate_epp_datalayer_rejected",
            "Load updates refused as malformed, by source.",
            ["source"],
            registry=r,
        )
        self._datalayer_children = {
            source: (
                self.datalayer_updates.labels(source),
                self.datalayer_bytes.labels(source),
                self.datalayer_cpu.labels(source),
            )
            for source in ("push", "scrape", "scrape_unchanged")
        }

    def datalayer_update(self, source: str, size: int, cpu_seconds: float) -> None:
        updates, size_total, cpu = self._datalayer_children[source]
        updates.inc()
        size_total.inc(size)
        cpu.inc(max(0.0, cpu_seconds))

    def observe_pick_age(self, state: EndpointState, now: float) -> None:
        """The freshness of the snapshot a decision used (the picked endpoint's)."""
        metrics = state.metrics
        self._age_children["push" if metrics.pushed else "scrape"].observe(metrics.freshness(now))

    def forget_endpoint(self, key: str) -> None:
        """Drop a departed endpoint's labelled series (fleet churn must not grow them)."""
        with contextlib.suppress(KeyError):
            self.scrape_errors.remove(key)

    def plugin_timer(self, plugin: Named, point: str, seconds: float) -> None:
        key = (id(plugin), point)
        child = self._plugin_children.get(key)
        if child is None:
            child = self.plugin_latency.labels(plugin.type_name, plugin.name, point)
            self._plugin_children[key] = child
        child.observe(seconds)

    # -- prefix index ground truth (issue: a self-calibrating prefix index) ---------------
    def _init_routing_outcomes(self, r: CollectorRegistry) -> None:
        """Counters of what the P/D handler and the response-affinity scorer decided."""
        self.pd_decisions = Counter(
            "infergate_epp_pd_decisions",
            "pd-profile-handler decisions: disaggregated (a prefill endpoint named in "
            "x-prefiller-host-port) or local (the decode endpoint prefills).",
            ["decision"],
            registry=r,
        )
        self.response_affinity = Counter(
            "infergate_epp_response_affinity",
            "Requests naming one of our response ids, by what response-affinity-scorer "
            "found: holder (a candidate), filtered (the filters removed the holder), "
            "unknown (the id's route tag names no known endpoint).",
            ["outcome"],
            registry=r,
        )

    def _init_prefix_prediction(self, r: CollectorRegistry) -> None:
        self.prefix_predicted_tokens = Counter(
            "infergate_epp_prefix_predicted_cached_tokens",
            "Cached prompt tokens the prefix index predicted on the endpoint that served.",
            registry=r,
        )
        self.prefix_actual_tokens = Counter(
            "infergate_epp_prefix_actual_cached_tokens",
            "Cached prompt tokens the engine reported (usage.prompt_tokens_details).",
            registry=r,
        )
        self.prefix_predictions = Counter(
            "infergate_epp_prefix_hit_predictions",
            "Hit predictions checked against the engine: correct, false_hit (predicted a hit, "
            "the engine had none) or missed_hit (the engine had a hit the index did not know).",
            ["outcome"],
            registry=r,
        )
        self._prediction_children = {
            outcome: self.prefix_predictions.labels(outcome)
            for outcome in ("correct", "false_hit", "missed_hit")
        }

    def observe_prefix_prediction(self, predicted_tokens: float, actual_tokens: int) -> None:
        """One response's ground truth against the index's prediction for it."""
        self.prefix_predicted_tokens.inc(max(0.0, predicted_tokens))
        self.prefix_actual_tokens.inc(max(0, actual_tokens))
        predicted_hit, actual_hit = predicted_tokens >= 1, actual_tokens > 0
        if predicted_hit == actual_hit:
            outcome = "correct"
        else:
            outcome = "false_hit" if predicted_hit else "missed_hit"
        self._prediction_children[outcome].inc()

    def prediction_accuracy(self) -> float | None:
        """Share of checked hit predictions that were right (None before any)."""
        counts = {k: c._value.get() for k, c in self._prediction_children.items()}
        total = sum(counts.values())
        return counts["correct"] / total if total else None

    # -- GIE's names (pkg/epp/metrics), next to ours ---------------------------------------
    def _init_gie(self, r: CollectorRegistry) -> None:
        labels = ["model_name", "target_model_name"]
        self.gie_requests = Counter(
            "inference_objective_request_total",
            "Counter of inference objective requests broken out for each model and target model.",
            labels,
            registry=r,
        )
        self.gie_errors = Counter(
            "inference_objective_request_error_total",
            "Counter of inference objective requests errors broken out for each model and "
            "target model.",
            [*labels, "error_code"],
            registry=r,
        )
        self.gie_duration = LoopHistogram(
            "inference_objective_request_duration_seconds",
            "Inference objective response latency distribution in seconds for each model and "
            "target model.",
            labels,
            buckets=GIE_DURATION_BUCKETS,
            registry=r,
        )
        self.gie_input_tokens = LoopHistogram(
            "inference_objective_input_tokens",
            "Inference objective input token count distribution for requests in each model.",
            labels,
            buckets=GIE_TOKEN_BUCKETS,
            registry=r,
        )
        self.gie_output_tokens = LoopHistogram(
            "inference_objective_output_tokens",
            "Inference objective output token count distribution for requests in each model.",
            labels,
            buckets=GIE_TOKEN_BUCKETS,
            registry=r,
        )
        self.gie_running = Gauge(
            "inference_objective_running_requests",
            "Inference objective number of running requests in each model.",
            ["model_name"],
            registry=r,
        )
        self.gie_scheduler_duration = LoopHistogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency distribution in seconds.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.gie_prefix_hit_ratio = LoopHistogram(
            "inference_extension_prefix_indexer_hit_ratio",
            "Ratio of prefix length matched to total prefix length in the cache lookup.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.gie_prefix_hit_bytes = LoopHistogram(
            "inference_extension_prefix_indexer_hit_bytes",
            "Length of the prefix match in number of bytes in the cache lookup.",
            buckets=GIE_BYTES_BUCKETS,
            registry=r,
        )
        self._gie_cache: dict[tuple[str, str], _GieChildren] = {}

    def _gie_children(self, model: str, target: str) -> _GieChildren:
        """The labelled children for (model, target), looked up once: prometheus-client's
        ``labels`` takes a lock and builds a tuple each call, four times per request."""
        children = self._gie_cache.get((model, target))
        if children is None:
            children = _GieChildren(
                self.gie_requests.labels(model, target),
                self.gie_running.labels(model),
                self.gie_duration.labels(model, target),
                self.gie_input_tokens.labels(model, target),
                self.gie_output_tokens.labels(model, target),
            )
            self._gie_cache[(model, target)] = children
        return children

    def request_started(self, model: str, target: str) -> None:
        children = self._gie_children(model, target)
        children.requests.inc()
        children.running.inc()

    def request_finished(
        self,
        model: str,
        target: str,
        seconds: float,
        status: int,
        prompt_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        children = self._gie_children(model, target)
        children.running.dec()
        children.duration.observe(seconds)
        if status >= 400 or status == 0:
            self.gie_errors.labels(model, target, str(status or "stream_error")).inc()
        if prompt_tokens:
            children.input_tokens.observe(prompt_tokens)
        if completion_tokens:
            children.output_tokens.observe(completion_tokens)
