"""A ZMQ SUB peer over a plain TCP socket, read only when a decision asks (no ZMQ I/O thread).

The feeds read lazily (the engines' load reports, the other replicas' admission records;
:mod:`infergate.epp.datalayer.completions`) were ZMQ SUB sockets. libzmq receives every
message on its I/O thread as it arrives, whether or not the application reads it: every
EPP replica's I/O thread woke for every report of every engine (~700 a 15 s run of the
routing lab, ~30 us each on a shared core, plus 8 heartbeats a second from 4 idle
engines; docs/benchmarks/scale.md, "Replicas"). Here the bytes wait in the kernel's
socket buffer (loopback's receive work is done on the sender's CPU time) and
:meth:`ZmtpFeed.read` takes all of them with a few ``recv`` calls at the decision.

It speaks what a libzmq PUB needs of a peer, ZMTP 3.0 (rfc.zeromq.org/spec/23) with the
NULL mechanism: a 64-byte greeting, a READY command naming the socket type, and one
subscription message per topic (``\\x01`` + topic; a 3.0 peer is sent subscriptions that
way, and the publisher then filters by topic as for any SUB socket). Frames: a flags
byte (MORE 1, LONG 2, COMMAND 4), a size of 1 byte (8, big-endian, when LONG), the body.
Commands from the publisher (its READY, PINGs) are skipped.

Dialling: from :meth:`ZmtpFeed.start` and after the connection is lost, a task connects
with a backoff (100 ms doubling to 2 s, as libzmq retries without end); what is found
lost at a read (end of stream, an error, a frame over ``max_frame``, a malformed stream)
is dialled again at once. A publisher drops what it sends while no subscriber is
connected, as with ZMQ. What waits unread is bounded by the kernel's buffers and the
publisher's high-water mark (it drops beyond it, as for a slow ZMQ subscriber).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterable

log = logging.getLogger("infergate.epp.datalayer.zmtp")

#: The greeting of a ZMTP 3.0 peer, NULL mechanism, as a client: signature, version 3.0,
#: mechanism name padded to 20 bytes, as-server 0, filler.
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
GREETING_SIZE = 64
MORE, LONG, COMMAND = 1, 2, 4
#: How long a connect may take before it is tried again.
CONNECT_TIMEOUT_S = 5.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.1, 2.0
#: The most bytes taken from the kernel per ``recv``.
RECV_BYTES = 1 << 18


class ZmtpError(ValueError):
    """The publisher sent something that is not ZMTP 3 (the connection is dropped)."""


def command(name: bytes, body: bytes = b"") -> bytes:
    """A short command frame: flags, size, name's length, name, body."""
    payload = bytes([len(name)]) + name + body
    if len(payload) > 255:
        raise ValueError("command too long for a short frame")
    return bytes([COMMAND, len(payload)]) + payload


def hello() -> bytes:
    """What a SUB client sends first: the greeting and its READY."""
    return GREETING + command(b"READY", b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB")


def subscriptions(topics: Iterable[bytes]) -> bytes:
    """One subscription message per topic. Sent only once the publisher's READY has come:
    libzmq takes what arrives before its own handshake is done as handshake commands, and
    drops the connection on a second one."""
    out = bytearray()
    for topic in topics:
        body = b"\x01" + topic
        out += (
            bytes([0, len(body)])
            if len(body) <= 255
            else bytes([LONG]) + len(body).to_bytes(8, "big")
        )
        out += body
    return bytes(out)


class FrameParser:
    """Messages out of a ZMTP 3 byte stream, the greeting first; fed in pieces.

    Every report of every engine passes through here, in every replica, so it is written
    for that: a read usually holds whole messages and is sliced as it came, and only an
    incomplete tail is kept (a large frame arriving over several reads is copied once it
    is complete, not at every read)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()  # an incomplete tail
        self._need = 0  # the bytes that tail must reach before it can hold a new frame
        self._greeted = False
        #: Commands received (the publisher's READY is the first).
        self.commands = 0
        self._frames: list[bytes] = []  # the message being read (its earlier frames)

    def feed(self, data: bytes) -> list[list[bytes]]:
        """The whole messages ``data`` completes; raises :class:`ZmtpError` on a bad stream."""
        if self._buffer:
            self._buffer += data
            if len(self._buffer) < self._need:
                return []
            data = bytes(self._buffer)
            self._buffer.clear()
        start = 0
        if not self._greeted:
            if len(data) < GREETING_SIZE:
                self._buffer += data
                self._need = GREETING_SIZE
                return []
            if data[0] != 0xFF or data[9] != 0x7F or data[10] < 3:
                raise ZmtpError("not a ZMTP 3 greeting")
            self._greeted, start = True, GREETING_SIZE
        end, max_frame = len(data), self.max_frame
        messages: list[list[bytes]] = []
        frames = self._frames
        need = 0
        while start + 2 <= end:
            flags = data[start]
            if flags & LONG:
                if start + 9 > end:
                    need = 9
                    break
                size, body = int.from_bytes(data[start + 1 : start + 9], "big"), start + 9
            else:
                size, body = data[start + 1], start + 2
            if size > max_frame:
                raise ZmtpError(f"a frame of {size} bytes (at most {max_frame})")
            stop = body + size
            if stop > end:
                need = stop - start
                break
            if flags & COMMAND:
                self.commands += 1  # READY, PING: nothing a reader needs
            else:
                frames.append(data[body:stop])
                if not flags & MORE:
                    messages.append(frames)
                    frames = []
            start = stop
        self._frames = frames
        if start < end:
            self._buffer += memoryview(data)[start:]
            self._need = need
        return messages


class ZmtpFeed:
    """A SUB peer of the PUB socket at ``host:port``, for ``topics``, read by :meth:`read`."""

    def __init__(self, host: str, port: int, topics: Iterable[bytes], max_frame: int) -> None:
        self.host, self.port = host, port
        self.url = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.max_frame = max_frame
        self._subscriptions = subscriptions(topics)
        self._sock: socket.socket | None = None
        self._parser = FrameParser(max_frame)
        self._dialling: asyncio.Task[None] | None = None
        self._closed = False
        #: Messages read so far; connections made and lost.
        self.read_count = 0
        self.connects = 0
        self.drops = 0

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def start(self) -> None:
        """Dial in the background (needs a running loop)."""
        if self._dialling is None and not self._closed:
            self._dialling = asyncio.get_running_loop().create_task(self._dial())

    async def _dial(self) -> None:
        backoff = FIRST_BACKOFF_S
        try:
            while not self._closed:
                family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                parser = FrameParser(self.max_frame)
                try:
                    await asyncio.wait_for(self._handshake(sock, parser), CONNECT_TIMEOUT_S)
                except (OSError, TimeoutError, ZmtpError) as error:
                    sock.close()
                    log.debug("dialling %s failed: %s", self.url, error)
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
                    continue
                self._sock, self._parser = sock, parser
                self.connects += 1
                return
        finally:
            self._dialling = None

    async def _handshake(self, sock: socket.socket, parser: FrameParser) -> None:
        """Connect, greet, wait for the publisher's READY, subscribe."""
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (self.host, self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_sendall(sock, hello())
        while parser.commands == 0:
            data = await loop.sock_recv(sock, 4096)
            if not data:
                raise ConnectionResetError("closed during the handshake")
            for _ in parser.feed(data):  # nothing is published before the handshake
                pass
        await loop.sock_sendall(sock, self._subscriptions)

    def read(self) -> list[list[bytes]]:
        """Every whole message received so far, without blocking. A connection found lost
        (or sending what is not ZMTP) is closed and dialled again."""
        sock = self._sock
        messages: list[list[bytes]] = []
        while sock is not None:
            try:
                data = sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:
                self._lost(str(error))
                break
            if not data:
                self._lost("closed by the engine")
                break
            try:
                messages += self._parser.feed(data)
            except ZmtpError as error:
                self._lost(str(error))
                break
            if len(data) < RECV_BYTES:
                break  # what the kernel held is read
        self.read_count += len(messages)
        return messages

    def _lost(self, why: str) -> None:
        log.warning("engine feed %s dropped (%s); redialling", self.url, why)
        self.drops += 1
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(RuntimeError):  # no running loop: closing down
            self.start()

    def close(self) -> None:
        self._closed = True
        if self._dialling is not None:
            self._dialling.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
