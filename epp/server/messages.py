"""Reading Envoy's ext-proc messages and building the EPP's answers, in place.

Why in place: nested protobuf constructors copy each level, which made a routed
request's answers cost twice as much to build. Every phase of
:class:`~infergate.epp.server.stream.StreamState` builds its answers with these.
"""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from infergate.epp.requestcontrol.requests import openai_error

from infergate.wire.names import (
    LB_METADATA_NAMESPACE,
    ORDER_DELAY_HEADER,
    PREFILL_HEADER,
    PREFIX_HEADER,
    SERVED_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

DESTINATION_NAMESPACE = LB_METADATA_NAMESPACE
SERVED_KEY = SERVED_HEADER
#: Request headers only the EPP may set: removed from what the client sent unless the
#: scheduling result sets them (P/D's prefill pick tells the decode engine whom to call;
#: the order delay places the request in the engine's queue).
OWNED_REQUEST_HEADERS = (PREFILL_HEADER, PREFIX_HEADER, ORDER_DELAY_HEADER)
SCORES_HEADER = "x-infergate-epp-scores"
CHUNK_LIMIT = 62_000  # under Envoy's 64 KiB per streamed chunk
BODY_NONE = processing_mode_pb2.ProcessingMode.NONE
BODY_BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_MODE = processing_mode_pb2.ProcessingMode
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def skip_response_headers(mode: processing_mode_pb2.ProcessingMode) -> None:
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


def header_map(headers: Any) -> dict[str, str]:
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


def metadata(request: pb.ProcessingRequest) -> dict[str, Any]:
    """Envoy's metadata as plain dicts (what ``json_format.MessageToDict`` gives, at a
    fraction of its cost: it runs on two messages of every request)."""
    if not request.HasField("metadata_context"):
        return {}
    return {
        namespace: {key: _value(item) for key, item in struct.fields.items()}
        for namespace, struct in request.metadata_context.filter_metadata.items()
    }


def subset(meta: dict[str, Any]) -> list[str] | None:
    """The endpoint subset Envoy's metadata asks for (None: any endpoint)."""
    hint = meta.get(SUBSET_NAMESPACE)
    if not isinstance(hint, dict) or SUBSET_KEY not in hint:
        return None
    value = hint[SUBSET_KEY]
    items = value if isinstance(value, list) else [value]
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            out.extend(part.strip() for part in item.split(",") if part.strip())
    return out


def fill_headers(mutation: pb.HeaderMutation, headers: dict[str, str]) -> None:
    """Adds ``headers`` to ``mutation`` as overwrites, built in place (see the module
    docstring). The mutation is marked present even when ``headers`` is empty."""
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
    fill_headers(response.headers, {"content-type": "application/json"})
    response.body = openai_error(status, message, param)
    response.details = message[:200]
    return answer


def body_message(piece: bytes, end_of_stream: bool, request_side: bool) -> pb.ProcessingResponse:
    """One streamed body chunk, built in place."""
    message = pb.ProcessingResponse()
    side = message.request_body if request_side else message.response_body
    streamed = side.response.body_mutation.streamed_response
    streamed.body = piece
    streamed.end_of_stream = end_of_stream
    return message


def body_chunks(
    body: bytes, end_of_stream: bool, request_side: bool
) -> list[pb.ProcessingResponse]:
    pieces = [body[i : i + CHUNK_LIMIT] for i in range(0, len(body), CHUNK_LIMIT)] or [b""]
    last = len(pieces) - 1
    return [
        body_message(piece, end_of_stream and i == last, request_side)
        for i, piece in enumerate(pieces)
    ]


def echo_chunks(chunks: list[bytes], end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """The request body's chunks as Envoy sent them (split only past ``CHUNK_LIMIT``)."""
    if any(len(chunk) > CHUNK_LIMIT for chunk in chunks):
        return body_chunks(b"".join(chunks), end_of_stream, True)
    if not chunks:
        return [body_message(b"", end_of_stream, True)]
    last = len(chunks) - 1
    return [body_message(c, end_of_stream and i == last, True) for i, c in enumerate(chunks)]
