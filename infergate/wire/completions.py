"""Completion records: the engine tells the Endpoint Picker when a request ended, and its usage.

Why: the EPP needs, per routed request, the end of the response (to release in-flight
and flow-control accounting), ``usage`` (tokens for fairness and the chars-per-token
calibration) and ``cached_tokens`` (the prefix index's calibration). Reading them from
the response body costs the EPP one gRPC message per SSE chunk, so a 512-token stream
cost it ~26 times a one-token answer. An engine that publishes one small record per
request makes that cost independent of the response's length, and lets Envoy send the
EPP no response body at all.

Wire format (ours; vLLM has no such channel): ZMQ PUB, multipart ``[topic, seq,
payload]`` like the KV events; ``topic`` is ``b"completions"``, ``seq`` a 64-bit
big-endian batch number from 0, ``payload`` msgpack of ``[ts, records]``, each record
the array ``[key, status, prompt_tokens, completion_tokens, cached_tokens, finished_at]``
(``finished_at`` in ``time.time()`` seconds; ``status`` the HTTP status the engine sent,
:data:`CLIENT_GONE` when the client went away first). ``key`` is the value of the
request's ``x-infergate-request-id`` header (:data:`KEY_HEADER`), which the EPP set when
it routed the request; a request without it (not routed by an EPP) produces no record.

Every subscribed EPP replica receives every record and keeps those it routed. PUB/SUB
drops what a subscriber is not connected for, so the EPP bounds how long it waits for a
record. The publisher is :mod:`infergate.engine.completion_events`; the subscriber
:mod:`infergate.epp.datalayer.completions`.
"""

from __future__ import annotations

import msgspec

from infergate.wire.names import REQUEST_ID_HEADER

TOPIC = b"completions"
#: The request header whose value keys a record (lower-case bytes, as ASGI gives headers).
KEY_HEADER = REQUEST_ID_HEADER.encode()
#: The status of a record whose client went away before the response ended (nginx's 499).
CLIENT_GONE = 499


class CompletionRecord(msgspec.Struct, array_like=True, gc=False):
    key: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finished_at: float


class CompletionBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    records: list[CompletionRecord]


def decode_batch(payload: bytes) -> CompletionBatch:
    return msgspec.msgpack.decode(payload, type=CompletionBatch)
