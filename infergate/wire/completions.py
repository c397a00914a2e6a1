"""Completion records: the engine tells the Endpoint Picker when a request ended, and its usage.

Why: the EPP needs, per routed request, the end of the response (to release in-flight
and flow-control accounting), ``usage`` (tokens for fairness and the chars-per-token
calibration) and ``cached_tokens`` (the prefix index's calibration). Reading them from
the response body costs the EPP one gRPC message per SSE chunk, so a 512-token stream
cost it ~26 times a one-token answer. An engine that publishes one small record per
request makes that cost independent of the response's length, and lets Envoy send the
EPP no response body at all.

Wire format (ours; vLLM has no such channel): ZMQ PUB, multipart ``[topic, seq,
payload]`` like the KV events; ``topic`` starts ``b"completions"`` (see Topics), ``seq`` a 64-bit
big-endian batch number from 0, ``payload`` msgpack of ``[ts, records]``, each record
the array ``[key, status, prompt_tokens, completion_tokens, cached_tokens, finished_at]``
(``finished_at`` in ``time.time()`` seconds; ``status`` the HTTP status the engine sent,
:data:`CLIENT_GONE` when the client went away first). ``key`` is the value of the
request's ``x-infergate-request-id`` header (:data:`KEY_HEADER`), which the EPP set when
it routed the request; a request without it (not routed by an EPP) produces no record.

**Admission records** (status :data:`ADMITTED`, 0) are published as the engine takes a
routed request's prompt (its first engine request is submitted), before any token is
generated: ``prompt_tokens`` is the prompt's length in the engine's tokens (completion
and cached tokens are 0), so the routing EPP learns the model's characters per token from
its first request instead of its first response. They also tell the *other* EPP replicas
where a prefix went: the EPP that routes a request puts its approximate-prefix block
hashes in the :data:`~infergate.wire.names.PREFIX_HEADER` header (:func:`encode_prefix`:
at most :data:`MAX_PREFIX_HASHES` little-endian u64s, base64url), and the engine echoes
those bytes as the record's seventh element ``prefix`` (empty in completion records and
when the request had no such header). Every replica but the routing one adds the hashes
to its prefix index for that engine, so replicas that never saw a request still score
its prefix as cached there. A request refused before it reaches the engine (a 400) has
no admission record. The engine does not interpret the hashes: the
text-chunk hashing stays the EPP's, configured in one place.

**Topics.** A batch goes out per routing replica: its topic is :func:`records_topic` of
the records' :func:`owner` (``b"completions."`` and the key up to its first ``-``: the
EPP that made the key, see ``ExtProcServer.new_key``), so each replica subscribes to its
own records alone and ZMQ filters the rest at the engine: a replica pays for the
requests it routed, not for every replica's. (A subscriber of plain :data:`TOPIC` still
receives every record.) An admission record that carries prefix hashes goes out a
second time, in a batch on :data:`ADMITTED_TOPIC` that every replica reads, lazily,
before its next decision (:mod:`infergate.epp.datalayer.completions`), at once (read
lazily, it costs a replica no wakeup, so holding it back would only delay it). PUB/SUB drops
what a subscriber is not connected for, so the EPP bounds how long it waits for a
record. The publisher is :mod:`infergate.engine.completion_events`; the subscriber
:mod:`infergate.epp.datalayer.completions`.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence

import msgspec

from infergate.wire.names import PREFIX_HEADER, REQUEST_ID_HEADER

TOPIC = b"completions"
#: The topic of admission records that carry prefix hashes, for every replica.
ADMITTED_TOPIC = b"admitted"
#: The request header whose value keys a record (lower-case bytes, as ASGI gives headers).
KEY_HEADER = REQUEST_ID_HEADER.encode()
#: The prefix-hashes header as ASGI gives it.
PREFIX_KEY_HEADER = PREFIX_HEADER.encode()
#: The status of an admission record (the engine accepted the request; no usage yet).
ADMITTED = 0
#: At most this many hashes travel (256 × 8 bytes: a 2,732-character header).
MAX_PREFIX_HASHES = 256
#: The longest header value :func:`decode_prefix` reads; anything longer is ignored.
MAX_PREFIX_HEADER_CHARS = (MAX_PREFIX_HASHES * 8 + 2) // 3 * 4
#: The status of a record whose client went away before the response ended (nginx's 499).
CLIENT_GONE = 499


class CompletionRecord(msgspec.Struct, array_like=True, gc=False):
    key: str
    status: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finished_at: float
    #: Admission records only: the packed hashes of :func:`encode_prefix` (raw bytes).
    prefix: bytes = b""


class CompletionBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    records: list[CompletionRecord]


def owner(key: str) -> str:
    """The replica that made a record's key: the key up to its first ``-`` (all of it
    without one)."""
    return key.partition("-")[0]


def records_topic(key_owner: str) -> bytes:
    """The topic of the records whose keys ``key_owner`` made (:func:`owner`)."""
    return TOPIC + b"." + key_owner.encode()


def decode_batch(payload: bytes) -> CompletionBatch:
    return msgspec.msgpack.decode(payload, type=CompletionBatch)


def encode_prefix(hashes: bytes | Sequence[int]) -> str:
    """The header value for a prompt's leading block hashes (at most MAX_PREFIX_HASHES),
    given as ints or already packed (little-endian u64s, as the EPP's index keeps them)."""
    if isinstance(hashes, bytes):
        packed = hashes[: MAX_PREFIX_HASHES * 8]
    else:
        head = hashes[:MAX_PREFIX_HASHES]
        packed = struct.pack(f"<{len(head)}Q", *head)
    return base64.urlsafe_b64encode(packed).rstrip(b"=").decode("ascii")


def decode_prefix(value: bytes | str) -> bytes:
    """The packed hashes of a header value; ``b""`` for anything malformed or too long
    (the engine echoes them unread, so it must not fail a request over them)."""
    if not value or len(value) > MAX_PREFIX_HEADER_CHARS:
        return b""
    raw = value.encode("ascii", "replace") if isinstance(value, str) else value
    try:
        packed = base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
    except (binascii.Error, ValueError):
        return b""
    return packed if is_packed_prefix(packed) else b""


def is_packed_prefix(packed: bytes) -> bool:
    """Whether ``packed`` is whole little-endian u64s, no more than a header may carry."""
    return not len(packed) % 8 and len(packed) <= MAX_PREFIX_HASHES * 8


def unpack_hashes(packed: bytes) -> list[int]:
    """Packed little-endian u64s as ints (``ValueError`` unless whole u64s)."""
    if len(packed) % 8:
        raise ValueError(f"packed hashes are whole little-endian u64s; got {len(packed)} bytes")
    return list(struct.unpack(f"<{len(packed) // 8}Q", packed))


def prefix_hashes(packed: bytes) -> list[int]:
    """The hashes of a record's ``prefix`` (empty when its length is not whole hashes)."""
    return unpack_hashes(packed) if is_packed_prefix(packed) else []
