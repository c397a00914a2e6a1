"""The response's phase (``Phase.RESPONSE``): its headers and body chunks passed back
to Envoy while the usage is read; its end completes the request."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from .messages import (
    DESTINATION_NAMESPACE,
    SERVED_KEY,
    body_chunks,
    fill_headers,
    header_map,
    metadata,
)
from .stream_base import Phase, StreamBase


class ResponsePhase(StreamBase):
    """The response side of :class:`~.stream.StreamState`."""

    def _stray_response(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if message.HasField("response_body"):
            return body_chunks(
                message.response_body.body, message.response_body.end_of_stream, False
            )
        if message.HasField("response_headers"):
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]

    def _response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.phase = Phase.RESPONSE
        headers = header_map(message.response_headers.headers)
        try:
            self.response.status = int(headers.get(":status", "0"))
        except ValueError:
            self.response.status = 0
        self.response.headers = headers
        self.response.metadata = metadata(message)
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
        fill_headers(answer.response_headers.response.header_mutation, extra)
        out = [answer]
        if message.response_headers.end_of_stream:
            self._complete()
        return out

    def _response_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = message.response_body.body
        eos = message.response_body.end_of_stream
        self.usage.feed(chunk)
        out = body_chunks(chunk, eos, False)
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
