"""What one ext-proc stream holds, and how it ends: the base of every phase's mixin.

:class:`StreamBase` declares the stream's fields (each phase reads and writes them) and
its lifecycle, the part the server and the observer call: :meth:`StreamBase._reject` (an
error answer, the body released), the end of the response (usage read, the engine's
completion record taken, the observer's end) and :meth:`StreamBase.close` (the request's
accounting released, once). The phases themselves are in ``stream_request``,
``stream_route`` and ``stream_response``; ``stream`` puts them together and dispatches
each message (see its docstring).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from infergate.epp.framework.requestcontrol import ResponseInfo
from infergate.epp.requestcontrol.director import Decision, Rejected
from infergate.epp.types import InferenceRequest

from infergate.wire.completions import CompletionRecord

from .messages import immediate
from .usage import UsageReader

if TYPE_CHECKING:
    from .extproc import ExtProcServer

log = logging.getLogger(__name__)

#: A rejection's status as the ``requests`` metric's outcome label.
_OUTCOMES = {
    400: "bad_request_400",
    408: "timeout_408",
    413: "too_large_413",
    429: "shed_429",
    503: "no_endpoint_503",
}


class Phase(enum.Enum):
    HEADERS = "awaiting request headers"
    BODY = "buffering request body"
    ROUTED = "routed"
    RESPONSE = "streaming response"
    DONE = "done"


class StreamBase:
    """The fields of one request's stream, and its endings (see the module docstring)."""

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
        #: (``_skips_response_headers``): its end and status come from the record.
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

    @property
    def ends_with_pick(self) -> bool:
        """The EPP ends the stream with its pick's answer: a streamed body whose response
        headers are skipped (``StreamState.handle_later``), which ``mode_override``
        cannot do in that mode. Envoy then sends nothing more; the end and status come
        from the record."""
        return self.headers_skipped and not self.body_buffered

    def _release_body(self) -> None:
        self.server.release(self.size + self.retained)
        self.chunks = []
        self.size = 0
        self.retained = 0

    def _reject(self, rejection: Rejected) -> list[pb.ProcessingResponse]:
        self.phase = Phase.DONE
        self._release_body()
        self.server.count(_OUTCOMES.get(rejection.status, "error"))
        if self.request is not None:
            log.info(
                "request %s rejected with %d: %s",
                self.request.request_id,
                rejection.status,
                rejection.message,
            )
        return [immediate(rejection.status, rejection.message, rejection.param)]

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
