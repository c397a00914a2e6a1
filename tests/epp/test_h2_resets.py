"""The native HTTP/2 connection (``native/grpc_h2``) takes any number of streams opened and
reset in one read without going away (issue 45 item 3).

Envoy resets the ext-proc stream of every client that goes away; in a burst, many
streams arrive opened and reset in the same read. The ``h2`` crate sends GOAWAY
ENHANCE_YOUR_CALM when more than its limit of such streams wait to be accepted, which
failed every other stream on the connection. Here the frames are written by hand, the
tightest a peer can make them, and fed in one piece.
"""

from __future__ import annotations

import struct

import infergate.epp._grpc_h2 as native
import pytest

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS = 0x1, 0x3, 0x4
END_HEADERS = 0x4
CANCEL = 0x8
# HPACK, static table indexed: :method POST, :scheme http, :path / (3 bytes).
REQUEST_HEADERS = bytes([0x83, 0x86, 0x84])


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream_id)
        + payload
    )


def connection(concurrency: int) -> native.GrpcConnection:
    return native.GrpcConnection(
        max_concurrent_streams=concurrency,
        max_message=1 << 20,
        window=1 << 20,
        max_frame_size=1 << 14,
        max_header_list_size=1 << 16,
    )


@pytest.mark.parametrize("concurrency", [2, 100, 11_000])
def test_streams_opened_and_reset_in_one_read_never_close_the_connection(
    concurrency: int,
) -> None:
    conn = connection(concurrency)
    opened = 5 * concurrency + 50  # far past every limit h2 has by default (20, 1024)
    data = bytearray(PREFACE + frame(SETTINGS, 0, 0, b""))
    for index in range(opened):
        stream_id = 2 * index + 1
        data += frame(HEADERS, END_HEADERS, stream_id, REQUEST_HEADERS)
        data += frame(RST_STREAM, 0, stream_id, struct.pack(">I", CANCEL))
    events = conn.receive(bytes(data))  # raised ConnectionError (ENHANCE_YOUR_CALM) before
    kinds = [kind for kind, _, _ in events]
    assert kinds.count(native.NEW) == opened
    assert kinds.count(native.CLOSED) == opened
    assert len(conn) == 0
    assert b"\x07" not in _frame_types(conn.data_to_send())  # no GOAWAY


def _frame_types(out: bytes) -> bytes:
    types, at = bytearray(), 0
    while at + 9 <= len(out):
        length = int.from_bytes(out[at : at + 3], "big")
        types.append(out[at + 3])
        at += 9 + length
    return bytes(types)


def test_a_concurrency_under_two_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        connection(1)
