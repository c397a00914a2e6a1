"""Prometheus metrics under vLLM's names, on the engine's own registry.

The EPP scrapes ``/metrics`` every 50 ms, so the live gauges are read at scrape time
from the scheduler (``set_function``: nothing to update per step, nothing stale) and the
exposition stays a few small families.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from infergate.engine.core.request import Request

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50 … up to `limit` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        *,
        block_size: int,
        num_gpu_blocks: int,
        max_model_len: int = 50_000,
    ) -> None:
        """Declare every family vLLM's /metrics has, in one place (long for a reason:
        one block per family keeps each name, help text and buckets beside the others,
        as vLLM's own metrics module does; splitting would scatter one schema)."""
        self.registry = CollectorRegistry()
        r, labels, m = self.registry, ["model_name"], model_name
        self.block_size, self.num_gpu_blocks = block_size, num_gpu_blocks
        self._live: tuple[Callable[[], float], ...] = (float, float, float, float)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self._running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self._kv_usage_legacy = gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's pre-0.10 name)."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(m)
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (by recompute).").labels(m)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.").labels(m)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.").labels(m)
        self._success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=TTFT_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
            buckets=ITL_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
            buckets=E2E_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time from arrival to first scheduling.",
            labels, buckets=E2E_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds", "Time from first scheduling to first token.",
            labels, buckets=E2E_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds", "Time from first token to the last.",
            labels, buckets=E2E_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt length of finished requests.",
            labels, buckets=TOKEN_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Output length of finished requests.",
            labels, buckets=TOKEN_BUCKETS, registry=r,
        ).labels(m)  # fmt: skip
        # Added with vLLM V1's `engine` label (engine index; one engine here: "0").
        per_engine, e = ["model_name", "engine"], "0"

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_engine, buckets=buckets, registry=r)

        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token of finished requests (decode time / (tokens - 1)).",
            TPOT_BUCKETS,
        ).labels(m, e)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Time from first scheduling to the last token (prefill + decode).",
            E2E_BUCKETS,
        ).labels(m, e)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens computed per engine step.",
            ITERATION_TOKEN_BUCKETS,
        ).labels(m, e)  # fmt: skip
        by_len = buckets_1_2_5(max_model_len)
        self.params_n = histogram("vllm:request_params_n", "The n of requests.", N_BUCKETS).labels(
            m, e
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens of requests.", by_len
        ).labels(m, e)
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Most output tokens among a finished request's sequences.",
            by_len,
        ).labels(m, e)
        Gauge(
            "vllm:cache_config_info",
            "KV-cache configuration.",
            ["block_size", "num_gpu_blocks"],
            registry=r,
        ).labels(str(block_size), str(num_gpu_blocks)).set(1)
        self._lora = LoRAInfoCollector()
        r.register(self._lora)
        self._model = m
        self._success_by_reason = {
            reason: self._success.labels(m, reason) for reason in ("stop", "length", "abort")
        }

    def bind(
        self,
        num_running: Callable[[], float],
        num_waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        pending_prefill: Callable[[], float] = float,
        waiting_prefill: Callable[[], float] = float,
    ) -> None:
        """Read live values from the engine at scrape time (``pending_prefill``: running
        requests' prompt tokens not yet computed; ``waiting_prefill``: waiting requests'
        uncached prompt tokens at arrival; both for load reports only)."""
        self._running.labels(self._model).set_function(num_running)
        self._waiting.labels(self._model).set_function(num_waiting)
        self._kv_usage.labels(self._model).set_function(kv_usage)
        self._kv_usage_legacy.labels(self._model).set_function(kv_usage)
        self._live = (num_running, num_waiting, kv_usage, pending_prefill, waiting_prefill)

    def bind_lora(
        self, running: Callable[[], set[str]], waiting: Callable[[], set[str]], max_lora: int
    ) -> None:
        """Adapters of running and waiting requests, read at scrape time."""
        self._lora.running, self._lora.waiting, self._lora.max_lora = running, waiting, max_lora

    def load_state(self) -> tuple[object, ...]:
        """The engine's load as a load report carries it (:mod:`infergate.wire.load`), in
        its field order from ``waiting``: read now, from the same sources as ``/metrics``."""
        running, waiting, kv_usage, pending_prefill, waiting_prefill = self._live
        prefill = self.prefill_time
        return (
            int(waiting()), int(running()), min(1.0, max(0.0, float(kv_usage()))),
            self.block_size, self.num_gpu_blocks, self._lora.max_lora,
            sorted(self._lora.running()), sorted(self._lora.waiting()),
            prefill._sum.get(), float(sum(b.get() for b in prefill._buckets)),
            self.request_prompt_tokens._sum.get(),
            self.prefix_hits._value.get(), self.prefix_queries._value.get(),
            max(0.0, float(pending_prefill())), max(0.0, float(waiting_prefill())),
        )  # fmt: skip

    def request_finished(self, reason: str) -> None:
        counter = self._success_by_reason.get(reason)
        if counter is not None:
            counter.inc()

    def request_completed(self, request: Request, now: float) -> None:
        """Per-request histograms of a request that ran to its end (not aborted)."""
        self.e2e.observe(now - request.arrival_time)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_output_tokens)
        if request.scheduled_time is not None:
            self.queue_time.observe(request.scheduled_time - request.arrival_time)
            if request.first_token_time is not None:
                self.prefill_time.observe(request.first_token_time - request.scheduled_time)
        if request.first_token_time is not None:
            self.decode_time.observe(now - request.first_token_time)
            if request.num_output_tokens > 1:
                self.tpot.observe(
                    (now - request.first_token_time) / (request.num_output_tokens - 1)
                )
        if request.scheduled_time is not None:
            self.inference_time.observe(now - request.scheduled_time)
        self.max_generation_tokens.observe(request.num_output_tokens)

    def request_accepted(self, n: int, max_tokens: int) -> None:
        """An API request's parameters (once per request, whatever its n)."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def render(self, names: Sequence[str] = ()) -> bytes:
        """The page; with ``names``, only those samples (``x_sum``, ``x_count``, ``x_total``
        or a family's own name), as prometheus_client's ``name[]`` filter selects them."""
        if names:
            return generate_latest(self.registry.restricted_registry(names))
        return generate_latest(self.registry)


class LoRAInfoCollector(Collector):
    """``vllm:lora_requests_info``, as vLLM emits it: a gauge whose value is the time of the
    update (Unix seconds) and whose labels carry the state — ``max_lora`` (the slot count,
    0 without LoRA), ``waiting_lora_adapters`` and ``running_lora_adapters`` (adapter
    names with waiting/running requests, comma-separated, sorted here for stable series).

    vLLM sets a new label set at every logging interval and old sets linger with older
    timestamps, which is why readers (GIE, our EPP) take the series with the newest value;
    we expose only the current one, computed at scrape time.
    """

    def __init__(self) -> None:
        self.running: Callable[[], set[str]] = set
        self.waiting: Callable[[], set[str]] = set
        self.max_lora = 0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        running, waiting = ",".join(sorted(self.running())), ",".join(sorted(self.waiting()))
        family.add_metric([str(self.max_lora), waiting, running], time.time())
        yield family


class SimulatorCollector(Collector):
    """Simulated mode only: how closely the steps keep to the timing model.

    ``infergate_sim_late_seconds_total / infergate_sim_modelled_seconds_total`` is the
    fraction by which steps overran their modelled time (CPU starvation, e.g. too many
    simulated engines on too few cores).
    """

    def __init__(self, runner: object) -> None:
        self.runner = runner

    def collect(self) -> Iterator[CounterMetricFamily]:
        r = self.runner
        yield CounterMetricFamily(
            "infergate_sim_steps", "Simulated steps.", value=getattr(r, "steps", 0)
        )
        yield CounterMetricFamily(
            "infergate_sim_modelled_seconds",
            "Modelled duration of all simulated steps.",
            value=getattr(r, "simulated_seconds", 0.0),
        )
        yield CounterMetricFamily(
            "infergate_sim_lora_loads",
            "LoRA adapters brought into a slot (each costs --sim-lora-load-ms).",
            value=getattr(r, "lora_loads", 0),
        )
        yield CounterMetricFamily(
            "infergate_sim_late_seconds",
            "Wall time by which simulated steps overran their modelled end, summed.",
            value=getattr(r, "late_seconds", 0.0),
        )
