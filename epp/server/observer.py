"""Watching a routed response from Envoy's second ext_proc filter (``observability_mode``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from infergate.wire.names import REQUEST_ID_HEADER

from .stream_base import StreamBase

if TYPE_CHECKING:
    from .extproc import ExtProcServer


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
        self.target: StreamBase | None = None
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
