"""Load reports: the engine pushes its load to the Endpoint Picker instead of being scraped.

Why: scraping ``/metrics`` every 50 ms costs the EPP an HTTP round trip and a parse per
endpoint per interval, whether anything changed or not (about 12 millicores per endpoint,
so one EPP topped out near 80 endpoints). An engine that pushes a small record when its
load changes, plus a heartbeat when it does not, costs the EPP a few decodes per second
per idle endpoint, and its data is as fresh as the engine's sampling tick.

Wire format (ours): on the engine's completion-records PUB socket
(``--completion-events-port``; see :mod:`infergate.wire.completions`), multipart
``[topic, seq, payload]`` with ``topic`` :data:`TOPIC` and ``seq`` a 64-bit big-endian
report number from 0 (its own sequence, apart from the completion batches'). ``payload``
is msgpack of the :class:`LoadReport` array. Every report is the whole state, never a
delta, so a lost report costs freshness until the next one and nothing else.

The engine samples its state every ``tick`` seconds and sends a report when something
changed, and at least every ``heartbeat`` seconds. The EPP takes ``heartbeat`` from the
report to judge that the stream is alive, and ``tick`` to bound how old the state it
holds can be while the stream is alive. Field bounds are checked at decode
(:data:`DECODER`): a report out of range is refused whole.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

TOPIC = b"load"

#: Counts are bounded by what one engine can hold; larger is garbage, not load.
_Count = Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000)]
_Total = Annotated[float, msgspec.Meta(ge=0.0, le=1e18)]
_Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Names = Annotated[list[_Name], msgspec.Meta(max_length=1024)]


class LoadReport(msgspec.Struct, array_like=True, gc=False):
    """One engine's load and cache configuration at ``sent_at`` (``time.time()``)."""

    sent_at: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    #: Seconds between state samples: a change reaches the EPP within about this.
    tick: _Seconds
    #: Longest gap between two reports when nothing changes.
    heartbeat: _Seconds
    waiting: _Count
    running: _Count
    #: KV-cache usage, 0 to 1 (vLLM's ``kv_cache_usage_perc``).
    kv_usage: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    block_size: _Count
    num_gpu_blocks: _Count
    #: LoRA: adapter slots (0 without LoRA), adapters of running and waiting requests.
    max_lora: _Count
    running_adapters: _Names
    waiting_adapters: _Names
    #: Cumulative counters for the EPP's prefill cost model, as vLLM's histograms give
    #: them: prefill seconds and count of finished requests, their prompt tokens, and
    #: prompt tokens hit in / looked up in the prefix cache.
    prefill_seconds_sum: _Total
    prefill_count: _Total
    prompt_tokens_total: _Total
    prefix_hits_total: _Total
    prefix_queries_total: _Total
    #: Prompt tokens of running requests not yet computed (a prefill in progress counts
    #: until its step ends): the prefill work ahead of a new request, whoever routed it.
    #: Last, with a default, so a report from an engine without it still decodes.
    prefill_pending_tokens: _Total = 0.0
    #: Prompt tokens of waiting requests that were not in the prefix cache when each
    #: arrived: the prefill queued behind the running ones. Last, with a default, as above.
    prefill_waiting_tokens: _Total = 0.0


#: The payload's size cap: a report is a few hundred bytes; LoRA names make it longer.
MAX_PAYLOAD = 1 << 20

ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(LoadReport)


def encode(report: LoadReport) -> bytes:
    return ENCODER.encode(report)


def decode(payload: bytes) -> LoadReport:
    """Decode and check one payload; raises ``ValueError`` on anything malformed."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"load report of {len(payload)} bytes (limit {MAX_PAYLOAD})")
    try:
        return DECODER.decode(payload)
    except msgspec.DecodeError as error:  # ValidationError is a subclass
        raise ValueError(f"bad load report: {error}") from None
