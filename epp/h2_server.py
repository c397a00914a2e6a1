"""gRPC for ext-proc, EDS and health on the EPP's own event loop (``--grpc-server h2``).

Why: under grpc.aio each gRPC event (a message in, a message sent, a stream's end) is
picked up by grpc's poller thread and handed to the asyncio loop through a wake-up socket,
then resumes the stream's task: thread hops and loop iterations per message, most of the
EPP's CPU per request (docs/architecture.md, "The ext-proc transport"). Here the loop
itself reads the HTTP/2 connection Envoy holds to the EPP: one socket read brings
whatever frames arrived for every stream, each complete gRPC message is handed to its
stream's :class:`~infergate.epp.server.StreamState` in place, and the answers of all
streams go out in one socket write.

What it implements of gRPC over HTTP/2 (``h2``'s connection state machine does the
framing, HPACK and flow-control accounting): length-prefixed messages without
compression, response headers / trailers (``grpc-status``, ``grpc-message``) and
trailers-only errors, RST_STREAM as cancellation, send-window flow control, GOAWAY on
stop, TLS with ALPN ``h2``. Methods are served from a table (:class:`Method`): the
ext-proc stream on a fast path (:class:`ExtProcCall`, no task per stream unless a
decision really waits, e.g. flow control queueing it), the rest (EDS, health) through
their asyncio servicers unchanged (:class:`AioCall`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from infergate.epp.server import ExtProcServer, ObserverState, Phase, StreamState, immediate

log = logging.getLogger("infergate.epp.h2_server")

_GRPC_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_END = object()
#: Our receive windows and frame size: large, since every byte is acknowledged as it is
#: read and the EPP's own limits (``Limits``) bound what a stream may hold.
_WINDOW = 16 << 20
_FRAME = 1 << 20
#: Handling received events for longer lets the loop serve others first (``_drain``).
_SLICE_S = 0.01


def _status(code: grpc.StatusCode) -> int:
    return int(code.value[0])


class _H2Connection(h2.connection.H2Connection):
    """``h2``'s connection state machine, counting open streams only every 64th time.

    ``h2`` counts them (and forgets closed ones) by a pass over every stream it tracks,
    each time a stream opens: quadratic when a backlog holds thousands open. The count
    only enforces the advertised stream limit, which is far above ``--max-streams``
    (the EPP answers 503 itself), so a count up to 64 streams old does.
    """

    _sweeps = 0
    _counted = 0

    def _open_streams(self, remainder: int) -> int:
        self._sweeps += 1
        if self._sweeps % 64 == 1:
            self._counted = super()._open_streams(remainder)
        return self._counted


class Stream:
    """One HTTP/2 stream: gRPC messages in, flow-controlled messages and trailers out."""

    __slots__ = ("buffer", "call", "conn", "headers_sent", "id", "pending", "trailers")

    def __init__(self, conn: Connection, stream_id: int) -> None:
        self.conn, self.id = conn, stream_id
        self.buffer = bytearray()  # a gRPC message not yet complete
        self.pending = bytearray()  # framed bytes waiting for the peer's send window
        self.headers_sent = False
        self.trailers: list[tuple[bytes, bytes]] | None = None  # set once: finishing
        self.call: ExtProcCall | AioCall | None = None

    def send(self, *payloads: bytes) -> None:
        """Messages in one go: their frames are cut across message boundaries, so a
        request body echoed as 16 KiB chunks (each just over Envoy's 16 KiB frame once
        framed) takes one DATA frame per chunk, not two."""
        if self.trailers is not None or self.id not in self.conn.streams:
            return
        pending = self.pending
        for payload in payloads:
            pending += len(payload).to_bytes(5, "big")  # flag 0 (not compressed), length
            pending += payload
        self.conn.pump(self)

    def finish(self, code: int = 0, message: str = "") -> None:
        """End the stream with ``grpc-status`` ``code`` once what is pending has gone."""
        if self.trailers is not None or self.id not in self.conn.streams:
            return
        self.trailers = [(b"grpc-status", str(code).encode())]
        if message:
            self.trailers.append((b"grpc-message", quote(message, safe=" ").encode()))
        self.conn.pump(self)


@dataclass(frozen=True, slots=True)
class Method:
    """A served gRPC method: ``ext_proc`` (the fast path), or an asyncio servicer method
    taking (request iterator | request, context): ``stream`` or ``unary`` requests."""

    kind: str
    call: Callable[..., Any]
    decode: Callable[[bytes], Any]


class Connection(asyncio.Protocol):
    """One HTTP/2 connection (Envoy holds one per worker thread to each EPP)."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.h2 = _H2Connection(
            h2.config.H2Configuration(
                client_side=False,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=False,
                normalize_inbound_headers=False,
            )
        )
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self._reading = False  # handling received events: one write at the end
        self._backlog: deque[h2.events.Event] = deque()  # received, not yet handled
        self._paused = False  # reading paused while the backlog is handled in slices
        self.peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.server.connections.add(self)
        # Streams past --max-streams get the EPP's own 503, so HTTP/2 allows more (h2's
        # default is 100); set before the preface, it is in force from the first stream.
        codes = h2.settings.SettingCodes
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                codes.MAX_CONCURRENT_STREAMS: self.server.max_streams + 1000,
                codes.MAX_HEADER_LIST_SIZE: self.h2.DEFAULT_MAX_HEADER_LIST_SIZE,
            },
        )
        self.h2.initiate_connection()
        self.h2.update_settings({codes.INITIAL_WINDOW_SIZE: _WINDOW, codes.MAX_FRAME_SIZE: _FRAME})
        self.h2.increment_flow_control_window(_WINDOW - 65_535)
        self.flush()

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as error:
            log.warning("gRPC connection from %s: HTTP/2 protocol error (%s)", self.peer, error)
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        self._backlog.extend(events)
        if not self._paused:  # paused: a scheduled _drain takes them
            self._drain()

    def _drain(self) -> None:
        """Handle received events for at most ``_SLICE_S``, then let the loop serve others.

        An event loop reads a busy socket in large pieces (uvloop: up to 256 KiB, libuv
        up to 32 reads per wake-up): with a backlog, one piece is ~100 requests to route.
        Handled whole, that would hold the loop long enough to delay every other
        connection, Envoy's health checks (1 s, one failure marks the EPP down) included;
        so reading pauses while the rest of the backlog waits its turn.
        """
        backlog = self._backlog
        started = time.monotonic()
        self._reading = True
        try:
            handled = 0
            while backlog:
                self._event(backlog.popleft())
                handled += 1
                if handled % 8 == 0 and time.monotonic() - started > _SLICE_S:
                    break
        finally:
            self._reading = False
        self.flush()
        transport = self.transport
        if transport is None or transport.is_closing():
            backlog.clear()
        elif backlog:
            if not self._paused:
                transport.pause_reading()
                self._paused = True
            asyncio.get_running_loop().call_soon(self._drain)
        elif self._paused:
            transport.resume_reading()
            self._paused = False

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            if event.flow_controlled_length:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            stream = self.streams.get(event.stream_id)
            if stream is not None and event.data:
                self._data(stream, event.data)
        elif isinstance(event, h2.events.RequestReceived):
            self._request(event.stream_id, event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None and stream.call is not None:
                stream.call.on_end()
        elif isinstance(event, h2.events.StreamReset):
            self._drop(event.stream_id)
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            for stream in list(self.streams.values()):
                if stream.pending:
                    self.pump(stream)

    def _request(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        stream = Stream(self, stream_id)
        self.streams[stream_id] = stream
        path = next((value for key, value in headers if key == b":path"), b"")
        method = self.server.methods.get(path)
        if method is None:
            stream.finish(_status(grpc.StatusCode.UNIMPLEMENTED), f"unknown method {path!r}")
        elif method.kind == "ext_proc":
            stream.call = ExtProcCall(method.call(), stream)
        else:
            stream.call = AioCall(method, stream)

    def _data(self, stream: Stream, data: bytes) -> None:
        """Complete gRPC messages of ``data`` to the stream's call, the rest kept. A frame
        that starts on a message boundary (the usual case) is read in place."""
        buffer = stream.buffer
        if buffer:
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        view = memoryview(data)
        start, end = 0, len(data)
        while end - start >= 5 and stream.trailers is None:
            size = int.from_bytes(view[start + 1 : start + 5], "big")
            if size > self.server.max_message:
                code = _status(grpc.StatusCode.RESOURCE_EXHAUSTED)
                self._fail(stream, code, f"message of {size} bytes over the limit")
                return
            if end - start < 5 + size:
                break
            if view[start]:
                self._fail(stream, _status(grpc.StatusCode.UNIMPLEMENTED), "compressed message")
                return
            message = data[start + 5 : start + 5 + size]
            start += 5 + size
            if stream.call is not None:
                stream.call.on_message(message)
        if start < end and stream.trailers is None:
            buffer += view[start:]

    def _fail(self, stream: Stream, code: int, message: str) -> None:
        stream.finish(code, message)
        if stream.call is not None:
            stream.call.on_close()

    def pump(self, stream: Stream) -> None:
        """Send what ``stream`` has pending as far as the windows allow, then its trailers."""
        h2conn = self.h2
        try:
            if stream.pending and not stream.headers_sent:
                h2conn.send_headers(stream.id, _GRPC_HEADERS)
                stream.headers_sent = True
            while stream.pending:
                size = min(
                    h2conn.local_flow_control_window(stream.id),
                    h2conn.max_outbound_frame_size,
                    len(stream.pending),
                )
                if size <= 0:
                    return  # WindowUpdated resumes it
                h2conn.send_data(stream.id, bytes(stream.pending[:size]))
                del stream.pending[:size]
            if stream.trailers is not None:
                headers = (
                    stream.trailers if stream.headers_sent else _GRPC_HEADERS + stream.trailers
                )
                h2conn.send_headers(stream.id, headers, end_stream=True)
                self._done(stream)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._drop(stream.id)  # the peer reset or closed it meanwhile
        if not self._reading:
            self.flush()

    def _done(self, stream: Stream) -> None:
        """Our side has ended. A peer still sending may go on (what it sends is dropped):
        a reset would let a gRPC client discard the answer it has not read yet."""
        self.streams.pop(stream.id, None)

    def _drop(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None and stream.call is not None:
            stream.call.on_close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._backlog.clear()
        for stream_id in list(self.streams):
            self._drop(stream_id)
        self.transport = None

    def goaway(self) -> None:
        with contextlib.suppress(h2.exceptions.H2Error):
            self.h2.close_connection()
            self.flush()


class _Resumed:
    """The rest of a coroutine that suspended on a loop future, awaited by a task."""

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        value = self.yielded
        while True:
            try:
                sent = yield value
            except BaseException as error:
                try:
                    value = self.coro.throw(error)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = self.coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _await(awaitable: _Resumed) -> Any:
    return await awaitable


class ExtProcCall:
    """One ext-proc stream: ``ExtProcServer.Process``'s loop, driven by arriving messages.

    A message's ``StreamState.handle`` runs in place; only when it suspends (the
    decision waits on the loop) does a task finish it, later messages waiting their turn.
    """

    def __init__(self, server: ExtProcServer, stream: Stream) -> None:
        self.server, self.stream = server, stream
        self.state = StreamState(server)
        self.observer: ObserverState | None = None
        self.busy: asyncio.Task[Any] | None = None
        self.backlog: deque[bytes | object] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        server.active_streams += 1
        self.refused = server.active_streams > server.limits.max_streams

    def on_message(self, raw: bytes) -> None:
        if self.closed:
            return
        if self.busy is not None:
            self.backlog.append(raw)
            return
        try:
            message = pb.ProcessingRequest.FromString(raw)
        except DecodeError as error:
            log.warning("ext-proc stream from %s: corrupt frame (%s)", self.stream.conn.peer, error)
            self._finish(_status(grpc.StatusCode.INVALID_ARGUMENT), "corrupt ProcessingRequest")
            return
        if self.refused:
            self.server.count("overloaded_503")
            self.state.phase = Phase.DONE
            log.warning("ext-proc stream refused: %d streams open", self.server.active_streams - 1)
            self._send([immediate(503, "the endpoint picker has too many requests open; retry")])
            self._finish()
            return
        if self.observer is not None:
            self.observer.handle(message)
            return
        if message.observability_mode and self.state.phase is Phase.HEADERS:
            self.observer = ObserverState(self.server)  # never answered (Envoy does not wait)
            self.observer.handle(message)
            return
        coro = self.state.handle(message)
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            self._answered(stop.value)
        except Exception:
            self._failed(message)
        else:
            self.busy = asyncio.get_running_loop().create_task(_await(_Resumed(coro, yielded)))
            self.busy.add_done_callback(lambda task: self._resumed(task, message))

    def _resumed(self, task: asyncio.Task[Any], message: pb.ProcessingRequest) -> None:
        self.busy = None
        if task.cancelled() or self.closed:
            return
        if task.exception() is not None:
            self._failed(message, task.exception())
        else:
            self._answered(task.result())
        while self.backlog and self.busy is None and not self.closed:
            item = self.backlog.popleft()
            if item is _END:
                self.on_end()
            else:
                assert isinstance(item, bytes)
                self.on_message(item)

    def _failed(self, message: pb.ProcessingRequest, error: BaseException | None = None) -> None:
        log.error(
            "ext-proc stream failed while handling %s",
            message.WhichOneof("request"),
            exc_info=error or True,
        )
        self.server.count("error")
        self.state.phase = Phase.DONE
        self._answered([immediate(500, "the endpoint picker failed on this request")])

    def _answered(self, responses: list[pb.ProcessingResponse]) -> None:
        self._send(responses)
        state = self.state
        if state.phase is Phase.BODY and state.deadline:
            if self.timer is None:
                self.timer = asyncio.get_running_loop().call_at(state.deadline, self._timed_out)
        elif self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _send(self, responses: list[pb.ProcessingResponse]) -> None:
        if responses:
            self.stream.send(*(response.SerializeToString() for response in responses))

    def _timed_out(self) -> None:
        self.timer = None
        if not self.closed and self.busy is None and self.state.phase is Phase.BODY:
            self._send(self.state.timed_out())
            self._finish()

    def on_end(self) -> None:
        """Envoy half-closed the stream: answer with OK trailers once nothing is pending."""
        if self.busy is not None:
            self.backlog.append(_END)
            return
        self._finish()

    def _finish(self, code: int = 0, message: str = "") -> None:
        self.stream.finish(code, message)
        self.on_close()

    def on_close(self) -> None:
        """The stream is over (finished, reset by Envoy or its connection gone)."""
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if self.busy is not None:
            self.busy.cancel()
        if self.observer is not None:
            self.observer.end(complete=False)
        else:
            self.state.close()
        self.server.active_streams -= 1


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What the asyncio servicers served here use of ``grpc.aio.ServicerContext``."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def peer(self) -> str:
        return self.stream.conn.peer

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> None:
        raise _Abort(code, details)

    async def write(self, message: Any) -> None:
        self.stream.send(message.SerializeToString())

    def set_code(self, code: grpc.StatusCode) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass


class AioCall:
    """An asyncio servicer method (EDS, health) on a stream.

    A unary call (a health check) runs in place when its request has ended, like an
    ext-proc message, so Envoy's checks are answered even while the loop is busy; a
    task takes over only if it suspends (``Watch``). A streaming call (EDS) is a task
    fed by a queue.
    """

    def __init__(self, method: Method, stream: Stream) -> None:
        self.method, self.stream = method, stream
        self.context = _Context(stream)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.request: Any = _END
        self.task: asyncio.Task[Any] | None = None
        if method.kind != "unary":
            result = method.call(self._requests(), self.context)
            self.task = asyncio.get_running_loop().create_task(self._serve(result))

    async def _requests(self) -> AsyncIterator[Any]:
        while (item := await self.queue.get()) is not _END:
            yield item

    async def _serve(self, result: Any) -> None:
        stream = self.stream
        try:
            if inspect.isasyncgen(result):
                item: Any
                async for item in result:
                    stream.send(item.SerializeToString())
            elif inspect.isawaitable(result):
                value = await result
                if value is not None:
                    stream.send(value.SerializeToString())
            stream.finish()
        except _Abort as abort:
            stream.finish(_status(abort.code), abort.details)
        except Exception:
            log.exception("gRPC call on %s failed", stream.conn.peer)
            stream.finish(_status(grpc.StatusCode.UNKNOWN), "internal error")

    def on_message(self, raw: bytes) -> None:
        try:
            request = self.method.decode(raw)
        except DecodeError as error:  # one line, as for ext-proc streams
            log.warning("gRPC stream from %s: corrupt frame (%s)", self.stream.conn.peer, error)
            self.stream.finish(_status(grpc.StatusCode.INVALID_ARGUMENT), "corrupt message")
            self.on_close()
            return
        if self.method.kind != "unary":
            self.queue.put_nowait(request)
        elif self.request is _END:
            self.request = request

    def on_end(self) -> None:
        if self.method.kind != "unary":
            self.queue.put_nowait(_END)
            return
        if self.task is not None:
            return
        if self.request is _END:
            self.stream.finish(_status(grpc.StatusCode.INVALID_ARGUMENT), "no request")
            return
        coro = self._serve(self.method.call(self.request, self.context))
        try:
            yielded = coro.send(None)
        except StopIteration:
            return
        self.task = asyncio.get_running_loop().create_task(_await(_Resumed(coro, yielded)))

    def on_close(self) -> None:
        if self.task is not None:
            self.task.cancel()


class H2Server:
    """The listening socket and its connections (see the module docstring)."""

    def __init__(self, methods: dict[str, Method], max_message: int, max_streams: int) -> None:
        self.methods = {path.encode(): method for path, method in methods.items()}
        self.max_message = max_message
        self.max_streams = max_streams
        self.connections: set[Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None, reuse_port: bool
    ) -> int:
        """Bind and serve; the bound port (``port`` 0 picks one). A busy port raises OSError."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self),
            host,
            port,
            ssl=ssl_context,
            reuse_port=reuse_port or None,
            backlog=1024,
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float) -> None:
        """Stop accepting, tell every connection to go away, and close them after ``grace``
        (or as soon as their streams have ended)."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.connections):
            connection.goaway()
        deadline = asyncio.get_running_loop().time() + grace
        while any(c.streams for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()
        await self._server.wait_closed()
        self._server = None
