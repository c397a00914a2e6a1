"""The Envoy ext-proc server: GIE's Endpoint Picker Protocol over FULL_DUPLEX_STREAMED.

One gRPC stream is one HTTP request. Its ``StreamState`` buffers the request body (the
headers response is withheld until the body ends, which FULL_DUPLEX_STREAMED allows),
routes, then answers with the headers response — ``x-gateway-destination-endpoint``
header plus the same value as dynamic metadata ``envoy.lb`` — followed by the body as
``StreamedBodyResponse`` chunks. Response headers and body chunks are passed straight
back while usage is read. Whatever happens to the stream (end, error, Envoy cancelling),
``close`` runs once and releases the request's accounting.

Memory is bounded (``Limits``): request bodies buffered across all streams share one
byte budget, concurrent streams have a cap, and a body must finish arriving within a
deadline. Beyond them the EPP answers at once with an OpenAI-shaped error — 503 for its
own limits (the client may retry, possibly on another replica), 408 for a body that
trickles past the deadline, 413 for one request over its own cap — so a flood of slow
or large uploads can never grow the process without bound. The budget covers a body
from its first chunk until its request ends (a routed request keeps its parsed prompt),
and the h2 transport charges it with what it holds (echoed bodies queued for Envoy's
windows). Worst-case RSS is about the idle RSS + 2.5 x ``max_buffered_bytes`` (the
budget, plus the joined copy and decoded document of the bodies being routed) + ~20 KiB
per stream; after a burst freed memory goes back to the kernel (``_settled``).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from infergate.epp.framework.requestcontrol import ResponseInfo
from infergate.epp.heap import TRIM_THRESHOLD, trim_heap
from infergate.epp.requestcontrol.director import Decision, Director, Rejected
from infergate.epp.requestcontrol.requests import openai_error
from infergate.epp.types import InferenceRequest

from infergate.wire.completions import ADMITTED, CompletionRecord
from infergate.wire.names import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    PREFILL_HEADER,
    PREFIX_HEADER,
    PRIORITY_HEADER,
    REQUEST_ID_HEADER,
    SERVED_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

log = logging.getLogger("infergate.epp.server")

DESTINATION_NAMESPACE = LB_METADATA_NAMESPACE
SERVED_KEY = SERVED_HEADER
#: Request headers only the EPP may set: removed from what the client sent unless the
#: scheduling result sets them (P/D's prefill pick tells the decode engine whom to call).
OWNED_REQUEST_HEADERS = (PREFILL_HEADER, PREFIX_HEADER)
SCORES_HEADER = "x-infergate-epp-scores"
CHUNK_LIMIT = 62_000  # under Envoy's 64 KiB per streamed chunk
USAGE_BUFFER_LIMIT = 4 << 20
BODY_NONE = processing_mode_pb2.ProcessingMode.NONE
BODY_BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_MODE = processing_mode_pb2.ProcessingMode


def _skip_response_headers(mode: processing_mode_pb2.ProcessingMode) -> None:
    """The routing filter's mode for a buffered body, without the response headers.
    Envoy takes an override whole (an unset body mode reads as NONE: the body would
    not come), so every field is the bootstrap's (``ext_proc_filter`` in
    ``infergate/envoy/bootstrap.py``)."""
    mode.request_header_mode = _MODE.SEND
    mode.response_header_mode = _MODE.SKIP
    mode.request_body_mode = _MODE.BUFFERED
    mode.response_body_mode = _MODE.NONE
    mode.request_trailer_mode = _MODE.SEND
    mode.response_trailer_mode = _MODE.SKIP


@dataclass(frozen=True, slots=True)
class Limits:
    """What one EPP process holds for requests in flight (see the module docstring)."""

    max_body_bytes: int = 8 << 20
    """One request's body; larger gets 413."""
    max_buffered_bytes: int = 128 << 20
    """Request bodies held across all streams (buffered, or routed and in flight, or in
    the transport); a chunk that would pass it gets 503."""
    max_streams: int = 10_000
    """Concurrent ext-proc streams; the next one gets 503 at its first message."""
    body_timeout_s: float | None = 20.0
    """From request headers to the body's last chunk; past it 408. Under Envoy's
    ext-proc ``message_timeout`` (30 s in our bootstrap) so the client gets our answer."""


#: A burst that held this many body bytes at once has its freed memory given back once
#: it is over (``ExtProcServer._settled``): glibc's own trim threshold (``heap``).
TRIM_AFTER_BYTES = TRIM_THRESHOLD
#: Held bytes counted as none: what the transport's write buffer may hold unseen.
SETTLED_BYTES = 1 << 20
#: The most often memory is given back (a trim holds the loop: 72 ms for 240 MiB freed).
TRIM_INTERVAL_S = 5.0


class Phase(enum.Enum):
    HEADERS = "awaiting request headers"
    BODY = "buffering request body"
    ROUTED = "routed"
    RESPONSE = "streaming response"
    DONE = "done"


def _header_map(headers: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for header in headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


def _value(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return {key: _value(item) for key, item in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_value(item) for item in value.list_value.values]
    if kind is None or kind == "null_value":
        return None
    return getattr(value, kind)


def _metadata(request: pb.ProcessingRequest) -> dict[str, Any]:
    """Envoy's metadata as plain dicts (what ``json_format.MessageToDict`` gives, at a
    fraction of its cost: it runs on two messages of every request)."""
    if not request.HasField("metadata_context"):
        return {}
    return {
        namespace: {key: _value(item) for key, item in struct.fields.items()}
        for namespace, struct in request.metadata_context.filter_metadata.items()
    }


def _subset(metadata: dict[str, Any]) -> list[str] | None:
    hint = metadata.get(SUBSET_NAMESPACE)
    if not isinstance(hint, dict) or SUBSET_KEY not in hint:
        return None
    value = hint[SUBSET_KEY]
    items = value if isinstance(value, list) else [value]
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            out.extend(part.strip() for part in item.split(",") if part.strip())
    return out


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _fill_headers(mutation: pb.HeaderMutation, headers: dict[str, str]) -> None:
    """Adds ``headers`` to ``mutation`` as overwrites, built in place: nested message
    constructors copy each level, which made a routed request's answers cost twice as
    much to build. The mutation is marked present even when ``headers`` is empty."""
    mutation.SetInParent()
    add = mutation.set_headers.add
    for key, value in headers.items():
        option = add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = _OVERWRITE


def immediate(status: int, message: str, param: str | None = None) -> pb.ProcessingResponse:
    answer = pb.ProcessingResponse()
    response = answer.immediate_response
    response.status.code = status
    _fill_headers(response.headers, {"content-type": "application/json"})
    response.body = openai_error(status, message, param)
    response.details = message[:200]
    return answer


def _body_message(piece: bytes, end_of_stream: bool, request_side: bool) -> pb.ProcessingResponse:
    """One streamed body chunk, built in place (nested constructors copy each level)."""
    message = pb.ProcessingResponse()
    side = message.request_body if request_side else message.response_body
    streamed = side.response.body_mutation.streamed_response
    streamed.body = piece
    streamed.end_of_stream = end_of_stream
    return message


def _body_chunks(
    body: bytes, end_of_stream: bool, request_side: bool
) -> list[pb.ProcessingResponse]:
    pieces = [body[i : i + CHUNK_LIMIT] for i in range(0, len(body), CHUNK_LIMIT)] or [b""]
    last = len(pieces) - 1
    return [
        _body_message(piece, end_of_stream and i == last, request_side)
        for i, piece in enumerate(pieces)
    ]


def _echo_chunks(chunks: list[bytes], end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """The request body's chunks as Envoy sent them (split only past ``CHUNK_LIMIT``)."""
    if any(len(chunk) > CHUNK_LIMIT for chunk in chunks):
        return _body_chunks(b"".join(chunks), end_of_stream, True)
    if not chunks:
        return [_body_message(b"", end_of_stream, True)]
    last = len(chunks) - 1
    return [_body_message(c, end_of_stream and i == last, True) for i, c in enumerate(chunks)]


class UsageReader:
    """Finds the ``usage`` object in a JSON response or in an SSE stream's events (the
    Responses API's sits in the ``response`` of its ``response.completed`` event)."""

    def __init__(self) -> None:
        self.sse = False
        self._buffer = bytearray()
        self.usage: dict[str, Any] | None = None
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buffer += chunk
        if self.sse:
            while True:
                cut = self._buffer.find(b"\n")
                if cut < 0:
                    break
                line = bytes(self._buffer[:cut]).strip()
                del self._buffer[: cut + 1]
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._take(line[5:].strip())
        if len(self._buffer) > USAGE_BUFFER_LIMIT:
            self._overflow = True
            self._buffer.clear()

    def finish(self) -> None:
        if self._overflow:
            return
        if self.sse:
            line = bytes(self._buffer).strip()
            if line.startswith(b"data:"):
                self._take(line[5:].strip())
        elif self._buffer:
            self._take(bytes(self._buffer))
        self._buffer.clear()

    def _take(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(doc, dict):
            return
        usage = doc.get("usage")
        if usage is None and isinstance(doc.get("response"), dict):
            usage = doc["response"].get("usage")  # a Responses stream's response.completed
        if isinstance(usage, dict):
            self.usage = usage


class StreamState:
    """The lifecycle of one request through the EPP (see the module docstring)."""

    def __init__(
        self, server: ExtProcServer, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.server = server
        #: The serving loop when the server knows it (each lookup is a system call).
        self.loop = loop
        self.phase = Phase.HEADERS
        self.request: InferenceRequest | None = None
        # The body as Envoy sent it: chunks kept as they came (joined once for parsing,
        # echoed back as they are when routing did not change the body).
        self.chunks: list[bytes] = []
        self.size = 0
        #: A routed request's body bytes, still reserved while it is in flight (_route).
        self.retained = 0
        self.subset: list[str] | None = None
        self.decision: Decision | None = None
        self.response = ResponseInfo()
        self.usage = UsageReader()
        self.body_mode_none = False
        #: Envoy buffers the body and sends it in one message, after the headers were
        #: answered; the pick then rides on the body's answer, which leaves the body as
        #: it is unless routing rewrote it (nothing to echo).
        self.body_buffered = False
        #: The routing filter streams no response body (the ``engine`` and ``observer``
        #: designs, see ``EnvoyConfig.response_accounting``).
        self.response_body_none = False
        #: The EPP asked Envoy not to send this request's response headers
        #: (:meth:`_skips_response_headers`): its end and status come from the record.
        self.headers_skipped = False
        self.closed = False
        self.deadline = 0.0  # loop time by which the body must have arrived
        # Response observation (see ``ObserverState``): while an observer is attached, the
        # request finishes when both this stream and the observer's have ended.
        self.key = ""
        self.observer_attached = False
        self.observer_ended = False
        self.stream_ended = False
        # Completion record from the engine (``infergate.epp.datalayer.completions``).
        self.record_received = False
        self.record_deadline = 0.0
        self.awaiting_since = 0.0
        #: When the engine's counts first showed this awaited response finished (0: not).
        self.counted_out_since = 0.0

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message of the stream (see :meth:`handle_now`)."""
        answers = self.handle_now(message)
        return answers if answers is not None else await self.handle_later(message)

    def handle_now(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | None:
        """The answers to ``message`` if it cannot wait on anything, or None: then
        :meth:`handle_later` it.

        Why: only a message that routes (the body's last chunk, headers without a body,
        trailers) may suspend, on flow control or a plugin's I/O. The others (headers
        before a body, every earlier chunk, the whole response side) are answered here,
        so the h2 server runs no coroutine or task for them: at 220 KB a streamed body is
        ~15 messages and one of them routes.
        """
        kind = message.WhichOneof("request") or ""
        if message.HasField("protocol_config"):
            mode = message.protocol_config.request_body_mode
            self.body_mode_none = mode == BODY_NONE
            self.body_buffered = mode == BODY_BUFFERED
            self.response_body_none = message.protocol_config.response_body_mode == BODY_NONE
        if self.phase is Phase.DONE:
            return []
        if kind == "request_headers":
            if self.phase is not Phase.HEADERS:
                return []
            if message.request_headers.end_of_stream or self.body_mode_none:
                return None  # routes on the headers alone
            return self._open(message)
        if kind == "request_body":
            if self.phase is not Phase.BODY:
                return []
            if message.request_body.end_of_stream or self.body_buffered:
                return None  # the whole body is here: it routes
            return self._take_chunk(message) or []
        if kind == "request_trailers":
            if self.phase is Phase.BODY:
                return None  # the body ended with trailers: it routes
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind.startswith("response_") and self.phase in (Phase.HEADERS, Phase.BODY):
            return self._stray_response(message)  # Envoy never does this; answer, change nothing
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message)
        if kind == "response_trailers":
            self._complete()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    async def handle_later(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to a message :meth:`handle_now` left: the one that routes."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self._open(message)
            return await self._route(end_of_stream=True, with_body=False)
        if kind == "request_body":
            rejected = self._take_chunk(message)
            if rejected is not None:
                return rejected
            return await self._route(end_of_stream=True)
        out = await self._route(end_of_stream=False)  # request trailers
        if self.phase is Phase.DONE:
            return out
        return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]

    def _open(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The request's headers: its identity and subset; the body is awaited next."""
        headers = _header_map(message.request_headers.headers)
        request_id = headers.get("x-request-id") or str(uuid.uuid4())
        self.request = InferenceRequest(request_id=request_id, headers=headers)
        self.subset = _subset(_metadata(message))
        self.phase = Phase.BODY
        if self.server.limits.body_timeout_s is not None:
            loop = self.loop or asyncio.get_running_loop()
            self.deadline = loop.time() + self.server.limits.body_timeout_s
        if self.body_buffered:  # Envoy sends the body once the headers are answered
            answer = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            if self._skips_response_headers():
                _skip_response_headers(answer.mode_override)
                self.headers_skipped = True
            return [answer]
        return []

    def _skips_response_headers(self) -> bool:
        """Whether this request's response headers need not come to the EPP.

        Why: Envoy holds the response headers until the EPP answers them, one round trip
        on every request's time to first byte, and two ext-proc messages of the EPP's
        CPU. Nothing needs them when no plugin adds response headers, the routing filter
        streams no response body, and every endpoint reports completion records, which
        carry the status and the token counts. Envoy still keeps the stream open until
        the response has ended (measured: 1.22 s for a 1.2 s generation), so the end is
        known as before. Envoy honours ``mode_override`` only on the answer to the
        request headers while it waits for that answer (measured: with
        ``FULL_DUPLEX_STREAMED`` bodies the pick's late headers answer has it ignored),
        so only buffered bodies can skip them.
        """
        server = self.server
        return (
            self.response_body_none
            and not server.director.hooks.response_header_hooks
            and server.reports_all is not None
            and server.reports_all()
        )

    def _take_chunk(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse] | None:
        """Holds a body chunk; the rejection if it is over a limit (None: taken)."""
        chunk = message.request_body.body
        limits = self.server.limits
        if self.size + len(chunk) > limits.max_body_bytes:
            return self._reject(
                Rejected(413, f"request body exceeds {limits.max_body_bytes} bytes")
            )
        if not self.server.reserve(len(chunk)):
            self.server.count("overloaded_503")
            return self._reject(
                Rejected(503, "the endpoint picker is buffering too many request bodies; retry")
            )
        if chunk:
            self.chunks.append(chunk)
            self.size += len(chunk)
        return None

    def _release_body(self) -> None:
        self.server.release(self.size + self.retained)
        self.chunks = []
        self.size = 0
        self.retained = 0

    def timed_out(self) -> list[pb.ProcessingResponse]:
        """The body did not arrive within ``Limits.body_timeout_s``."""
        return self._reject(
            Rejected(408, f"request body not received within {self.server.limits.body_timeout_s} s")
        )

    def _reject(self, rejection: Rejected) -> list[pb.ProcessingResponse]:
        self.phase = Phase.DONE
        self._release_body()
        self.server.count(
            {
                400: "bad_request_400",
                408: "timeout_408",
                413: "too_large_413",
                429: "shed_429",
                503: "no_endpoint_503",
            }.get(rejection.status, "error")
        )
        if self.request is not None:
            log.info(
                "request %s rejected with %d: %s",
                self.request.request_id,
                rejection.status,
                rejection.message,
            )
        return [immediate(rejection.status, rejection.message, rejection.param)]

    async def _route(
        self, end_of_stream: bool, with_body: bool = True
    ) -> list[pb.ProcessingResponse]:
        assert self.request is not None
        chunks = self.chunks
        raw = (chunks[0] if len(chunks) == 1 else b"".join(chunks)) if with_body else None
        held = self.size
        self.chunks = []
        self.size = 0
        routed = False
        try:  # the bytes stay reserved while they are parsed and routed
            decision = await self.server.director.route(self.request, raw or None, self.subset)
            routed = True
        except Rejected as rejection:
            return self._reject(rejection)
        finally:
            # Routed, the request keeps its parsed body (the prompt, the messages) for
            # plugins until it is over: its bytes stay reserved until then (close).
            if routed:
                self.retained = held
            else:
                self.server.release(held)
        self.decision = decision
        self.phase = Phase.ROUTED
        self.server.count("routed")
        # GIE's two carriers, each in the form its consumers parse: the header names the
        # primary pick alone (an ORIGINAL_DST cluster keyed on it dials exactly one
        # address), the envoy.lb metadata the ordered list, primary first (override_host
        # walks it on retries).
        destination = decision.destination
        primary = destination.split(",", 1)[0]
        self.key = self.server.new_key()
        self.server.routed[self.key] = self
        headers = {
            **decision.result.request_headers,
            DESTINATION_HEADER: primary,
            REQUEST_ID_HEADER: self.key,
            # The objective's priority for the engine's scheduler, in vLLM's convention
            # (lower first); always set, so a client's own copy never gets through.
            PRIORITY_HEADER: str(-decision.request.priority),
        }
        if decision.body_rewritten and decision.body is not None:
            headers["content-length"] = str(len(decision.body))
        if self.server.scores_header:
            headers[SCORES_HEADER] = json.dumps(decision.result.totals, separators=(",", ":"))
        # Built in place (see _fill_headers). A buffered body's headers were answered
        # already; its answer may still set them, and replaces the body only where
        # routing rewrote it.
        answer = pb.ProcessingResponse()
        buffered = self.body_buffered and with_body
        common = answer.request_body.response if buffered else answer.request_headers.response
        _fill_headers(common.header_mutation, headers)
        # A client must not pick the prefill engine for the decode engine.
        common.header_mutation.remove_headers.extend(
            h for h in OWNED_REQUEST_HEADERS if h not in headers
        )
        common.clear_route_cache = True
        answer.dynamic_metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: destination}})
        if buffered:
            if decision.body_rewritten:
                common.body_mutation.body = decision.body or b""
            decision.body = None  # copied into the answer: not kept for the request's life
            return [answer]
        if not with_body or raw is None:
            return [answer]
        if decision.body_rewritten:
            body, decision.body = decision.body or b"", None  # not kept: see above
            return [answer, *_body_chunks(body, end_of_stream, True)]
        decision.body = None
        # Unchanged: what Envoy sent goes back as it came, without joining or copying.
        return [answer, *_echo_chunks(chunks, end_of_stream)]

    def _stray_response(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if message.HasField("response_body"):
            return _body_chunks(
                message.response_body.body, message.response_body.end_of_stream, False
            )
        if message.HasField("response_headers"):
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]

    def _response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.phase = Phase.RESPONSE
        headers = _header_map(message.response_headers.headers)
        try:
            self.response.status = int(headers.get(":status", "0"))
        except ValueError:
            self.response.status = 0
        self.response.headers = headers
        self.response.metadata = _metadata(message)
        lb = self.response.metadata.get(DESTINATION_NAMESPACE)
        served = lb.get(SERVED_KEY) if isinstance(lb, dict) else None
        self.response.served_endpoint = served if isinstance(served, str) else ""
        self.usage.sse = "text/event-stream" in headers.get("content-type", "")
        extra = self.server.director.response_headers(self.decision, self.response)
        endpoint = self.response.served_endpoint or (
            self.decision.result.targets[0].key
            if self.decision and self.decision.result.targets
            else ""
        )
        if endpoint:
            extra[SERVED_KEY] = endpoint
        answer = pb.ProcessingResponse()
        _fill_headers(answer.response_headers.response.header_mutation, extra)
        out = [answer]
        if message.response_headers.end_of_stream:
            self._complete()
        return out

    def _response_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = message.response_body.body
        eos = message.response_body.end_of_stream
        self.usage.feed(chunk)
        out = _body_chunks(chunk, eos, False)
        if eos:
            self._complete()
        return out

    def _complete(self) -> None:
        """Response finished normally: read usage, then release."""
        if self.closed:
            return
        self._read_usage()
        self.close()
        self.phase = Phase.DONE

    def _read_usage(self) -> None:
        if self.response.complete:
            return
        self.usage.finish()
        usage = self.usage.usage or {}
        # OpenAI chat/completions names, then the Responses API's (and Anthropic's).
        for fields, attr in (
            (("prompt_tokens", "input_tokens"), "prompt_tokens"),
            (("completion_tokens", "output_tokens"), "completion_tokens"),
        ):
            value = next((usage[f] for f in fields if f in usage), None)
            if isinstance(value, int):
                setattr(self.response, attr, value)
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.response.cached_tokens = details["cached_tokens"]
        self.response.complete = True

    @property
    def endpoint_key(self) -> str:
        if self.response.served_endpoint:
            return self.response.served_endpoint
        targets = self.decision.result.targets if self.decision is not None else []
        return targets[0].key if targets else ""

    def _awaits_record(self) -> bool:
        """A routed 2xx response from an engine that reports completions ends with its record."""
        reports = self.server.reports_completions
        return (
            reports is not None
            and not self.record_received
            and not self.response.complete
            and self.decision is not None
            # Skipped response headers: the status is unknown until the record brings it.
            and (200 <= self.response.status < 300 or self.headers_skipped)
            and reports(self.endpoint_key)
        )

    def take_record(self, record: CompletionRecord | None) -> None:
        """The engine's completion record arrived (None: it will not, give up waiting)."""
        if self.record_received or self.closed:
            return
        self.record_received = True
        if record is not None:
            response = self.response
            response.prompt_tokens = record.prompt_tokens
            response.completion_tokens = record.completion_tokens
            response.cached_tokens = record.cached_tokens
            if response.status == 0:
                response.status = record.status
            response.complete = record.status < 400
        if self.stream_ended:
            self.close()

    def observed_end(self, complete: bool) -> None:
        """The observer saw the response end (``complete``) or its stream went away."""
        if complete:
            self._read_usage()
        self.observer_ended = True
        if self.stream_ended:
            self.close()

    def close(self) -> None:
        """Release everything this request holds; safe to call more than once.

        With an observer attached the request is not over until the observer says so:
        Envoy ends this stream right after the response headers.
        """
        if self.closed:
            return
        self.stream_ended = True
        if self.observer_attached and not self.observer_ended:
            return
        if self._awaits_record():
            self.server.await_record(self)
            return
        self.closed = True
        self.server.awaiting.pop(self.key, None)
        if self.key:
            self.server.routed.pop(self.key, None)
        self._release_body()
        if self.decision is not None:
            self.server.director.finish(self.decision, self.response)


class ObserverState:
    """A second ext_proc filter in ``observability_mode`` watching one routed response.

    Envoy sends it the response headers and body chunks without waiting for answers, and
    ignores its failures: the EPP reads usage (and the end of the response) here at the
    cost of receiving each chunk, never answering it, and its death cuts no stream. The
    routing stream (``StreamState``) has no response body to pass back and is closed by
    Envoy after the response headers, so nothing there can break a response either.
    """

    def __init__(self, server: ExtProcServer) -> None:
        self.server = server
        self.target: StreamState | None = None
        self.done = False

    def handle(self, message: pb.ProcessingRequest) -> None:
        kind = message.WhichOneof("request") or ""
        if kind == "request_headers":
            if self.target is None and not self.done:
                key = ""
                for header in message.request_headers.headers.headers:
                    if header.key == REQUEST_ID_HEADER:
                        key = header.raw_value.decode("ascii", "replace") or header.value
                        break
                target = self.server.routed.get(key)
                if target is not None and not target.observer_attached:
                    target.observer_attached = True
                    self.target = target
            return
        target = self.target
        if target is None or self.done:
            return
        if kind == "response_headers":
            headers = message.response_headers.headers.headers
            for header in headers:
                if header.key == "content-type":
                    value = header.raw_value or header.value.encode()
                    target.usage.sse = b"text/event-stream" in value
            if message.response_headers.end_of_stream:
                self.end(complete=True)
        elif kind == "response_body":
            target.usage.feed(message.response_body.body)
            if message.response_body.end_of_stream:
                self.end(complete=True)
        elif kind == "response_trailers":
            self.end(complete=True)

    def end(self, complete: bool) -> None:
        if self.done:
            return
        self.done = True
        if self.target is not None:
            self.target.observed_end(complete)


class ExtProcServer(pb_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        director: Director,
        limits: Limits | int = Limits(),
        scores_header: bool = False,
        reports_completions: Callable[[str], bool] | None = None,
        reports_all: Callable[[], bool] | None = None,
        record_timeout_s: float = 330.0,
        record_settle_s: float = 1.0,
    ) -> None:
        self.director = director
        # An int is the old signature's max_body_bytes.
        self.limits = limits if isinstance(limits, Limits) else Limits(max_body_bytes=limits)
        self.scores_header = scores_header
        self.active_streams = 0
        self.buffered_bytes = 0
        #: Body bytes the HTTP/2 transport holds beyond the streams' sight (partial
        #: messages; echoed bodies queued until Envoy's windows take them, which left
        #: ``buffered_bytes`` when they were routed): charged to the same budget.
        self.transport_bytes = 0
        #: Times a burst's freed memory was given back to the kernel (:meth:`_settled`).
        self.trims = 0
        self._burst_peak = 0  # the most held since the last trim
        self._last_trim = -TRIM_INTERVAL_S
        self._trim_timer: asyncio.TimerHandle | None = None
        self.metrics = director.metrics
        self.routed: dict[str, StreamState] = {}  # REQUEST_ID_HEADER -> its routing stream
        # Routed requests' keys: random per server, then counted (a uuid4 per request
        # read the kernel's randomness each time, a system call on the request path).
        self._key_prefix = os.urandom(8).hex()
        self._keys = itertools.count(1)
        #: Whether an endpoint reports completion records (None: none does). Its 2xx
        #: responses then finish when the record arrives, or after ``record_timeout_s``
        #: (a record lost: PUB/SUB drops while disconnected) as incomplete.
        self.reports_completions = reports_completions
        #: Whether every endpoint reports completions (None: not known, taken as no).
        self.reports_all = reports_all
        self.record_timeout_s = record_timeout_s
        #: How long the engine's counts must keep showing an awaited response finished
        #: before its record is given up (see :meth:`_counted_out`).
        self.record_settle_s = record_settle_s
        self.awaiting: dict[str, StreamState] = {}  # streams ended, record not yet in
        #: Called with (endpoint, packed hashes) of requests another replica routed.
        self.on_admitted: Callable[[str, bytes], Any] | None = None

    def new_key(self) -> str:
        """A routed request's ``x-infergate-request-id``: unique among this EPP's requests
        and, by its 64 random bits, among every replica's (engines' records carry it to
        all of them)."""
        return f"{self._key_prefix}-{next(self._keys):x}"

    def await_record(self, state: StreamState) -> None:
        if state.key not in self.awaiting:
            now = asyncio.get_running_loop().time()
            state.awaiting_since = now
            state.record_deadline = now + self.record_timeout_s
            self.awaiting[state.key] = state

    def on_record(self, endpoint: str, record: CompletionRecord) -> None:
        """A record from ``endpoint``. Completion records of other replicas are ignored;
        admission records of other replicas go to ``on_admitted`` (the prefix index), this
        replica's own to the director's request-admitted hooks (the prompt's token count)."""
        state = self.routed.get(record.key)
        if record.status == ADMITTED:
            if state is None:
                if record.prefix and self.on_admitted is not None:
                    self.on_admitted(endpoint, record.prefix)
            elif state.decision is not None and record.prompt_tokens > 0:
                self.director.admitted(state.decision, record.prompt_tokens)
            return
        if state is not None:
            state.take_record(record)

    def expire_records(self, now: float, gone: str | None = None) -> int:
        """Give up on records past their deadline (or all of endpoint ``gone``'s)."""
        expired = [
            s for s in self.awaiting.values()
            if s.record_deadline <= now or (gone is not None and s.endpoint_key == gone)
        ]  # fmt: skip
        seen = set(expired)
        expired += [s for s in self._counted_out(now) if s not in seen]
        for state in expired:
            self.count("record_lost")
            state.take_record(None)
        return len(expired)

    def _counted_out(self, now: float) -> list[StreamState]:
        """Awaited responses that their engine's own counts show finished.

        A request whose response headers were sent stays in its engine's running (or,
        preempted, waiting) count until it finishes. So of the responses awaited since
        before an engine's latest scrape, at most running + waiting can still be live;
        the rest finished and their records were lost (PUB/SUB drops). The oldest are
        given up first: a count bound, so whichever is released the endpoint's in-flight
        count becomes right. A response is given up only once the counts have shown it
        finished for ``record_settle_s``: a record sent as its request finished, or a
        request admitted just after the scrape was rendered, settles within that. An
        engine whose scrape lacks either gauge is not judged (its counts read 0).
        """
        by_endpoint: dict[str, list[StreamState]] = {}
        for state in self.awaiting.values():
            by_endpoint.setdefault(state.endpoint_key, []).append(state)
        out: list[StreamState] = []
        for key, states in by_endpoint.items():
            endpoint = self.director.datastore.get(key)
            metrics = endpoint.metrics if endpoint is not None else None
            suspects: set[StreamState] = set()
            if metrics is not None and metrics.updated_at > 0.0 and metrics.counts_reported:
                before = sorted(
                    (s for s in states if s.awaiting_since < metrics.updated_at),
                    key=lambda s: s.awaiting_since,
                )
                suspects = set(before[: max(0, len(before) - metrics.running - metrics.waiting)])
            for state in states:
                if state not in suspects:
                    state.counted_out_since = 0.0
                elif not state.counted_out_since:
                    state.counted_out_since = now
                elif now - state.counted_out_since >= self.record_settle_s:
                    out.append(state)
        return out

    @property
    def max_body_bytes(self) -> int:
        return self.limits.max_body_bytes

    def count(self, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the shared body budget; False when it would overflow.
        What the transport holds (``transport_bytes``) counts against it too."""
        held = self.buffered_bytes + self.transport_bytes + size
        if held > self.limits.max_buffered_bytes:
            return False
        self.buffered_bytes += size
        self._burst_peak = max(self._burst_peak, held)
        return True

    def release(self, size: int) -> None:
        self.buffered_bytes = max(0, self.buffered_bytes - size)
        self._settled()

    def hold_in_transport(self, delta: int) -> None:
        """The transport holds ``delta`` more body bytes (fewer when negative)."""
        self.transport_bytes = max(0, self.transport_bytes + delta)
        if delta > 0:
            self._burst_peak = max(self._burst_peak, self.buffered_bytes + self.transport_bytes)
        else:
            self._settled()

    def _settled(self) -> None:
        """After a burst (``TRIM_AFTER_BYTES`` held at once, or half the budget if less),
        once almost nothing is held, give the freed memory back
        (:func:`~infergate.epp.heap.trim_heap`), at most every ``TRIM_INTERVAL_S``
        (later, on a timer, if the last was too recent).

        Why: the burst's buffers are freed all over malloc's heap, which keeps them
        (measured 534 MiB of RSS, 43 MiB in use, after 100 bodies of 8 MiB). A small
        residue (``SETTLED_BYTES``) counts as settled: the transport's write buffer is
        read only when it writes, so a few KiB may be left over from its last write.
        """
        burst = min(TRIM_AFTER_BYTES, self.limits.max_buffered_bytes // 2)
        if self._burst_peak < burst or self._trim_timer is not None:
            return
        if self.buffered_bytes + self.transport_bytes > SETTLED_BYTES:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a test driving streams by hand): no timer
            loop = None
        now = loop.time() if loop is not None else self._last_trim + TRIM_INTERVAL_S
        wait = self._last_trim + TRIM_INTERVAL_S - now
        if wait > 0 and loop is not None:
            self._trim_timer = loop.call_later(wait, self._trim_later)
            return
        self._burst_peak = 0
        self._last_trim = now
        if trim_heap():
            self.trims += 1
            log.debug("burst over: freed memory given back to the kernel")

    def _trim_later(self) -> None:
        self._trim_timer = None
        self._settled()

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        loop = asyncio.get_running_loop()
        state = StreamState(self, loop)
        self.active_streams += 1
        messages = request_iterator.__aiter__()
        observer: ObserverState | None = None
        try:
            if self.active_streams > self.limits.max_streams:
                self.count("overloaded_503")
                state.phase = Phase.DONE
                log.warning("ext-proc stream refused: %d streams open", self.active_streams - 1)
                try:  # answer Envoy's first message (its request headers), hold nothing
                    await messages.__anext__()
                except StopAsyncIteration:
                    return
                yield immediate(503, "the endpoint picker has too many requests open; retry")
                return
            while True:
                try:
                    if observer is not None:
                        message = await messages.__anext__()
                        observer.handle(message)
                        continue
                    if state.phase is Phase.BODY and state.deadline:
                        message = await asyncio.wait_for(
                            messages.__anext__(), max(0.0, state.deadline - loop.time())
                        )
                    else:
                        message = await messages.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    for response in state.timed_out():
                        yield response
                    return
                except DecodeError as error:
                    # Not a ProcessingRequest: a broken or foreign client, not a fault
                    # here. One line (gRPC would log a traceback per stream), and the
                    # stream ends with INVALID_ARGUMENT; `finally` releases its state.
                    log.warning(
                        "ext-proc stream from %s: corrupt frame (%s)", context.peer(), error
                    )
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "corrupt ProcessingRequest"
                    )
                if message.observability_mode and state.phase is Phase.HEADERS:
                    observer = ObserverState(self)  # never answered (Envoy does not wait)
                    observer.handle(message)
                    continue
                try:
                    responses = await state.handle(message)
                except Exception:
                    log.exception(
                        "ext-proc stream failed while handling %s", message.WhichOneof("request")
                    )
                    self.count("error")
                    state.phase = Phase.DONE
                    responses = [immediate(500, "the endpoint picker failed on this request")]
                for response in responses:
                    yield response
        finally:
            if observer is not None:
                observer.end(complete=False)
            else:
                state.close()
            self.active_streams -= 1
