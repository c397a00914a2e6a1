"""One ext-proc stream, one HTTP request: :class:`StreamState`, the EPP's hot path.

The request goes through its phases (:class:`~.stream_base.Phase`) in order, each in
its own module, all mixed into :class:`StreamState` over :class:`~.stream_base.StreamBase`
(the fields and the lifecycle):

1. ``HEADERS`` (``stream_request``): the request headers open the request.
2. ``BODY`` (``stream_request``): body chunks are held against the server's limits;
   the headers response is withheld until the body ends (FULL_DUPLEX_STREAMED allows
   it), or answered at once when Envoy buffers the body.
3. ``ROUTED`` (``stream_route``): the body's last chunk (or headers without a body, or
   the request trailers) routes; the answer carries the pick, then the body.
4. ``RESPONSE`` (``stream_response``): response headers and body chunks go straight
   back while usage is read. Where nothing needs them, the response headers never come:
   a buffered body's headers answer tells Envoy to skip them, and a streamed body's
   stream ends with the pick's answer (``StreamBase.ends_with_pick``; the transport
   sends OK trailers after it).
5. ``DONE``: whatever happens to the stream (end, error, Envoy cancelling), ``close``
   runs once and releases the request's accounting.

:meth:`StreamState.handle_now` is the dispatch: it answers every message that cannot
wait on anything without a coroutine, and leaves the one that routes to
:meth:`StreamState.handle_later`.
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from .messages import BODY_BUFFERED, BODY_NONE
from .stream_base import Phase
from .stream_request import RequestPhases
from .stream_response import ResponsePhase
from .stream_route import RoutePhase


class StreamState(RequestPhases, RoutePhase, ResponsePhase):
    """The lifecycle of one request through the EPP (see the module docstring)."""

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
            out = await self._route(end_of_stream=True, with_body=False)
        elif kind == "request_body":
            rejected = self._take_chunk(message)
            if rejected is not None:
                return rejected
            out = await self._route(end_of_stream=True)
        else:  # request trailers
            out = await self._route(end_of_stream=False)
            if self.phase is Phase.DONE:
                return out
            out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        if self.phase is Phase.ROUTED and not self.body_buffered:
            self.headers_skipped = self._skips_response_headers()  # then ends_with_pick
        return out
