"""The request's phases before routing: its headers (``Phase.HEADERS``) and its body
arriving chunk by chunk (``Phase.BODY``), held against the server's limits."""

from __future__ import annotations

import asyncio
import uuid

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from infergate.epp.requestcontrol.director import Rejected
from infergate.epp.types import InferenceRequest

from .messages import header_map, metadata, skip_response_headers, subset
from .stream_base import Phase, StreamBase


class RequestPhases(StreamBase):
    """Headers, then body chunks: what :class:`~.stream.StreamState` does before routing."""

    def _open(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The request's headers: its identity and subset; the body is awaited next."""
        headers = header_map(message.request_headers.headers)
        request_id = headers.get("x-request-id") or str(uuid.uuid4())
        self.request = InferenceRequest(request_id=request_id, headers=headers)
        self.subset = subset(metadata(message))
        self.phase = Phase.BODY
        if self.server.limits.body_timeout_s is not None:
            loop = self.loop or asyncio.get_running_loop()
            self.deadline = loop.time() + self.server.limits.body_timeout_s
        if self.body_buffered:  # Envoy sends the body once the headers are answered
            answer = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            if self._skips_response_headers():
                skip_response_headers(answer.mode_override)
                self.headers_skipped = True
            return [answer]
        return []

    def _skips_response_headers(self) -> bool:
        """Whether this request's response headers need not come to the EPP.

        Why: Envoy holds the response headers until the EPP answers them, one round trip
        on every request's time to first byte, and two ext-proc messages (a wake-up) of
        the EPP's CPU. Nothing needs them when no plugin adds response headers, the
        routing filter streams no response body, and every endpoint reports completion
        records, which carry the status and the token counts; Envoy's route sets
        ``x-gateway-destination-endpoint-served`` itself.

        How they are skipped depends on the body mode. Envoy honours ``mode_override``
        only on the answer to the request headers while it waits for that answer, and
        never with ``FULL_DUPLEX_STREAMED`` bodies (Envoy's ext_proc filter ignores it in
        that mode). So a buffered body's headers answer overrides the mode (Envoy then
        keeps the stream open until the response has ended: measured 1.22 s for a 1.2 s
        generation), and a streamed body's stream is ended by the EPP right after the
        pick's answer, with OK trailers: Envoy, its processing complete, forwards the
        response untouched (``StreamState.handle_later``). Either way the request's end
        and status come from its record.
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

    def timed_out(self) -> list[pb.ProcessingResponse]:
        """The body did not arrive within ``Limits.body_timeout_s``."""
        return self._reject(
            Rejected(408, f"request body not received within {self.server.limits.body_timeout_s} s")
        )
