"""The routing step (``Phase.BODY`` -> ``Phase.ROUTED``): the Director picks, and the
pick goes back to Envoy as GIE's two carriers, with the body echoed or rewritten."""

from __future__ import annotations

import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from infergate.epp.requestcontrol.director import Decision, Rejected

from infergate.wire.names import DESTINATION_HEADER, PRIORITY_HEADER, REQUEST_ID_HEADER

from .messages import (
    DESTINATION_NAMESPACE,
    OWNED_REQUEST_HEADERS,
    SCORES_HEADER,
    body_chunks,
    echo_chunks,
    fill_headers,
)
from .stream_base import Phase, StreamBase


class RoutePhase(StreamBase):
    """Routes the request once its body is whole (:meth:`_route`)."""

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
        self.key = self.server.new_key()
        self.server.routed[self.key] = self
        return self._routed(decision, chunks, raw, end_of_stream, with_body)

    def _routed(
        self,
        decision: Decision,
        chunks: list[bytes],
        raw: bytes | None,
        end_of_stream: bool,
        with_body: bool,
    ) -> list[pb.ProcessingResponse]:
        """The answers that carry ``decision`` to Envoy, built in place (see
        ``messages``). A buffered body's headers were answered already; its answer may
        still set them, and replaces the body only where routing rewrote it."""
        # GIE's two carriers, each in the form its consumers parse: the header names the
        # primary pick alone (an ORIGINAL_DST cluster keyed on it dials exactly one
        # address), the envoy.lb metadata the ordered list, primary first (override_host
        # walks it on retries).
        destination = decision.destination
        primary = destination.split(",", 1)[0]
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
        answer = pb.ProcessingResponse()
        buffered = self.body_buffered and with_body
        common = answer.request_body.response if buffered else answer.request_headers.response
        fill_headers(common.header_mutation, headers)
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
            return [answer, *body_chunks(body, end_of_stream, True)]
        decision.body = None
        # Unchanged: what Envoy sent goes back as it came, without joining or copying.
        return [answer, *echo_chunks(chunks, end_of_stream)]
