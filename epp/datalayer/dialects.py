"""Metric dialects: which Prometheus names mean queue, running, KV usage, LoRA, cache config.

vLLM's names are the default (our engine emits them); SGLang's are chosen by the pod label
``inference.networking.k8s.io/engine-type: sglang``. A scrape asks for those samples
alone (:meth:`Dialect.query`, prometheus_client's ``name[]`` filter). Parsing reads only
the sample lines of the wanted families, found by one regex scan of the page (a full
page, from a server that ignores the filter, carries dozens of histograms we never
read), and takes their values directly; only the label sets the
EPP reads (adapters, cache config) go through prometheus_client's parser, cached, since
that parser costs ~20 µs a line and a page changes those label sets rarely.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import urlencode

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

    @cached_property
    def _families(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Each family parsing reads, with the suffixes of the samples it reads: gauges
        and info series as named, histograms' ``_sum`` and ``_count`` (never their
        buckets), counters' ``_total``."""
        plain: tuple[str, ...] = ("",)
        names = (*self.waiting, *self.running, *self.kv_usage, self.lora_info, self.cache_config)
        out = [(n, plain) for n in names if n]
        out += [(n, ("_sum", "_count")) for n in (self.prefill_time, self.prompt_tokens) if n]
        out += [(n, ("_total",)) for n in (self.prefix_hits, self.prefix_queries) if n]
        return tuple(out)

    def wanted(self) -> tuple[bytes, ...]:
        """The families' names, as the page scan matches them."""
        return tuple(name.encode() for name, _ in self._families)

    def sample_names(self) -> tuple[str, ...]:
        """The exact sample names parsing reads (:attr:`_families` with their suffixes)."""
        return tuple(name + suffix for name, suffixes in self._families for suffix in suffixes)

    def query(self) -> str:
        """``name[]=…`` for each sample name: prometheus_client's exposition app (vLLM's
        ``/metrics``, and infergate's engine) then renders only those samples, ~1.6 KB
        instead of a ~30 KB page of histograms the EPP never reads. A server that ignores
        the query sends the whole page, which parses the same."""
        return urlencode([("name[]", name) for name in self.sample_names()])


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


def _line_pattern(wanted: tuple[bytes, ...]) -> re.Pattern[bytes]:
    """Sample lines of the wanted families (histograms: ``_sum`` and ``_count`` only)."""
    names = b"|".join(re.escape(name) for name in wanted)
    return re.compile(rb"\n((?:" + names + rb")(?:_sum|_count|_total)?)([ {][^\n]*)")


_PATTERNS: dict[tuple[bytes, ...], re.Pattern[bytes]] = {}
_LABELS: dict[bytes, dict[str, str]] = {}


def _sample_lines(text: bytes, wanted: tuple[bytes, ...]) -> list[tuple[bytes, bytes]]:
    """(name, rest of line) of every sample of a wanted family, found by one C-level
    regex scan of the page: a 30 KB vLLM page has ~400 lines and the EPP needs ~10."""
    pattern = _PATTERNS.get(wanted)
    if pattern is None:
        pattern = _PATTERNS[wanted] = _line_pattern(wanted)
    return pattern.findall(b"\n" + text)


def _value(name: bytes, rest: bytes) -> tuple[bytes, float]:
    """Split ``{labels} value [timestamp]`` into (labels, value); ValueError if malformed."""
    labels = b""
    if rest.startswith(b"{"):
        close = rest.rfind(b"}")
        if close < 0:
            raise ValueError(f"unterminated labels in {name.decode(errors='replace')}")
        labels, rest = rest[: close + 1], rest[close + 1 :]
    fields = rest.split()
    if not 1 <= len(fields) <= 2:
        raise ValueError(f"bad sample line for {name.decode(errors='replace')}")
    return labels, float(fields[0])


def _labels(name: bytes, labels: bytes) -> dict[str, str]:
    """Parse a label set with prometheus_client's parser (cached: adapter and cache-config
    label sets change rarely, and parsing is the expensive part of a scrape)."""
    parsed = _LABELS.get(labels)
    if parsed is None:
        line = (name + labels + b" 1\n").decode("utf-8", "replace")
        parsed = {}
        for family in text_string_to_metric_families(line):
            for sample in family.samples:
                parsed = dict(sample.labels)
        if len(_LABELS) >= 256:  # bounded: a new label set per scrape must not grow it
            _LABELS.clear()
        _LABELS[labels] = parsed
    return parsed


def _split_names(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def parse_metrics(text: bytes, dialect: Dialect) -> Metrics:
    """Read one scrape; missing families leave defaults. Raises ValueError on garbage."""
    values: dict[str, float] = {}
    metrics = Metrics(updated_at=time.monotonic())
    lora_stamp = -1.0
    for raw_name, rest in _sample_lines(text, dialect.wanted()):
        label_text, value = _value(raw_name, rest)
        name = raw_name.decode()
        if name == dialect.lora_info:
            if value >= lora_stamp:  # the newest series describes current adapters
                lora_stamp = value
                labels = _labels(raw_name, label_text)
                metrics.active_models = _split_names(labels.get("running_lora_adapters", ""))
                metrics.waiting_models = _split_names(labels.get("waiting_lora_adapters", ""))
                try:
                    metrics.max_active_models = int(float(labels.get("max_lora", "0")))
                except ValueError:
                    metrics.max_active_models = 0
        elif name == dialect.cache_config:
            labels = _labels(raw_name, label_text)
            try:
                metrics.block_size = int(labels.get("block_size", "0"))
                metrics.num_gpu_blocks = int(labels.get("num_gpu_blocks", "0"))
            except ValueError:
                pass
        else:  # sum across label sets (e.g. one series per model_name / engine)
            values[name] = values.get(name, 0.0) + value

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
