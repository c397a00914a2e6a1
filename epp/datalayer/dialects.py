"""Metric dialects: which Prometheus names mean queue, running, KV usage, LoRA, cache config.

vLLM's names are the default (our engine emits them); SGLang's are chosen by the pod label
``inference.networking.k8s.io/engine-type: sglang``. Parsing keeps only the lines of the
wanted families and hands those to prometheus_client's parser — a scrape page carries
dozens of histograms we never read, and filtering first cuts the parse cost several-fold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from infergate.epp.types import Endpoint, Metrics
from prometheus_client.parser import text_string_to_metric_families

ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"


@dataclass(frozen=True)
class Dialect:
    name: str
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]
    lora_info: str | None = None
    cache_config: str | None = None
    #: For the prefill cost model: the prefill-time and prompt-length histograms (both
    #: observed when a request finishes, so their ``_sum``s line up) and the prefix-cache
    #: hit counter (``_total``).
    prefill_time: str | None = None
    prompt_tokens: str | None = None
    prefix_hits: str | None = None
    prefix_queries: str | None = None

    def wanted(self) -> tuple[bytes, ...]:
        names = [*self.waiting, *self.running, *self.kv_usage]
        names += [
            n
            for n in (
                self.lora_info,
                self.cache_config,
                self.prefill_time,
                self.prompt_tokens,
                self.prefix_hits,
                self.prefix_queries,
            )
            if n
        ]
        return tuple(n.encode() for n in names)


VLLM = Dialect(
    "vllm",
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    lora_info="vllm:lora_requests_info",
    cache_config="vllm:cache_config_info",
    prefill_time="vllm:request_prefill_time_seconds",
    prompt_tokens="vllm:request_prompt_tokens",
    prefix_hits="vllm:prefix_cache_hits",
    prefix_queries="vllm:prefix_cache_queries",
)
SGLANG = Dialect(
    "sglang",
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
)
DIALECTS = {"vllm": VLLM, "sglang": SGLANG}


def dialect_for(endpoint: Endpoint) -> Dialect:
    return DIALECTS.get((endpoint.label(ENGINE_TYPE_LABEL) or "vllm").lower(), VLLM)


def _relevant_lines(text: bytes, wanted: tuple[bytes, ...]) -> str:
    keep = []
    for line in text.splitlines():
        if b"_bucket{" in line:  # histograms: only _sum and _count are read
            continue
        if line.startswith(b"#"):
            parts = line.split(b" ", 3)
            if len(parts) >= 3 and parts[2].startswith(wanted):
                keep.append(line)
        elif line.startswith(wanted):
            keep.append(line)
    return b"\n".join(keep).decode("utf-8", "replace") + "\n"


def _split_names(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def parse_metrics(text: bytes, dialect: Dialect) -> Metrics:
    """Read one scrape; missing families leave defaults. Raises ValueError on garbage."""
    values: dict[str, float] = {}
    metrics = Metrics(updated_at=time.monotonic())
    lora_stamp = -1.0
    for family in text_string_to_metric_families(_relevant_lines(text, dialect.wanted())):
        for sample in family.samples:
            name = sample.name
            if name == dialect.lora_info:
                if sample.value >= lora_stamp:  # the newest series describes current adapters
                    lora_stamp = sample.value
                    labels = sample.labels
                    metrics.active_models = _split_names(labels.get("running_lora_adapters", ""))
                    metrics.waiting_models = _split_names(labels.get("waiting_lora_adapters", ""))
                    try:
                        metrics.max_active_models = int(float(labels.get("max_lora", "0")))
                    except ValueError:
                        metrics.max_active_models = 0
            elif name == dialect.cache_config:
                try:
                    metrics.block_size = int(sample.labels.get("block_size", "0"))
                    metrics.num_gpu_blocks = int(sample.labels.get("num_gpu_blocks", "0"))
                except ValueError:
                    pass
            else:  # sum across label sets (e.g. one series per model_name / engine)
                values[name] = values.get(name, 0.0) + sample.value

    def first(names: tuple[str, ...]) -> float | None:
        for n in names:
            if n in values:
                return values[n]
        return None

    waiting = first(dialect.waiting)
    running = first(dialect.running)
    kv = first(dialect.kv_usage)
    metrics.waiting = int(waiting or 0)
    metrics.running = int(running or 0)
    metrics.counts_reported = waiting is not None and running is not None
    metrics.kv_usage = float(kv or 0.0)
    if dialect.prefill_time:
        metrics.prefill_seconds_sum = values.get(dialect.prefill_time + "_sum", 0.0)
        metrics.prefill_count = values.get(dialect.prefill_time + "_count", 0.0)
    if dialect.prompt_tokens:
        metrics.prompt_tokens_total = values.get(dialect.prompt_tokens + "_sum", 0.0)
    if dialect.prefix_hits:
        metrics.prefix_hits_total = values.get(dialect.prefix_hits + "_total", 0.0)
    if dialect.prefix_queries:
        metrics.prefix_queries_total = values.get(dialect.prefix_queries + "_total", 0.0)
    return metrics
