"""gRPC for ext-proc, EDS and health on the EPP's own event loop (``--grpc-server h2``).

Why: under grpc.aio each gRPC event (a message in, a message sent, a stream's end) is
picked up by grpc's poller thread and handed to the asyncio loop through a wake-up socket,
then resumes the stream's task: thread hops and loop iterations per message, most of the
EPP's CPU per request (docs/architecture.md, "The ext-proc transport"). Here the loop
itself reads the HTTP/2 connection Envoy holds to the EPP: one socket read brings
whatever frames arrived for every stream, each complete gRPC message is handed to its
stream's :class:`~infergate.epp.server.stream.StreamState` in place, and the answers of all
streams go out in one socket write.

What it implements of gRPC over HTTP/2 (the native module ``_grpc_h2``, built from
``native/grpc_h2`` around the ``h2`` crate, does the framing, HPACK, flow control and
stream states, and cuts the length-prefixed messages): messages without compression,
response headers / trailers (``grpc-status``, ``grpc-message``) and trailers-only errors,
RST_STREAM as cancellation, send-window flow control, GOAWAY on stop, TLS with ALPN
``h2``. Methods are served from a table (:class:`Method`): the ext-proc stream on a fast
path (:class:`ExtProcCall`: a message is handled in place, the one that routes under its
own task, see :func:`step_in_place`), the rest (EDS, health) through their asyncio
servicers unchanged (:class:`AioCall`).
"""

from __future__ import annotations

import asyncio
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
import infergate.epp._grpc_h2 as native
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from .extproc import ExtProcServer
from .messages import immediate
from .observer import ObserverState
from .stream import StreamState
from .stream_base import Phase

log = logging.getLogger(__name__)

_END = object()
#: Our receive windows (per stream W and per connection C) and frame size: large, since
#: every byte is acknowledged as it is read. So the windows do not bound memory (W and C
#: are replenished at once); the body budget B (``--max-buffered-bytes``) does, charged
#: with what the streams hold (bodies until routed, a routed request's until it ends) and
#: what each connection holds (:meth:`Connection._account`: partial messages, answers
#: queued for Envoy's windows, the transport's write buffer). Holding back the window
#: until a message completes would bound partial messages by min(C, streams x W) but
#: stall every stream once partial messages fill C (a message may be larger than C); so
#: the one uncounted term is partial messages, each at most one ext-proc message: one
#: chunk when Envoy streams the body (the default), up to the body cap when it buffers.
#: Peak: idle + B + the copies of the bodies being parsed (docs/epp.md).
_WINDOW = 16 << 20
_FRAME = 1 << 20
_MAX_HEADER_LIST = 64 << 10
#: Handling received events for longer lets the loop serve others first (``_drain``).
_SLICE_S = 0.01


def _status(code: grpc.StatusCode) -> int:
    return int(code.value[0])


class Stream:
    """One HTTP/2 stream, as the calls see it: messages out, then a status."""

    __slots__ = ("call", "conn", "finished", "id")

    def __init__(self, conn: Connection, stream_id: int) -> None:
        self.conn, self.id = conn, stream_id
        self.finished = False  # our side has ended: later messages are dropped
        self.call: ExtProcCall | AioCall | None = None

    def send(self, *payloads: bytes) -> None:
        """Messages in one go: framed together and queued as one send, which the native
        layer cuts into DATA frames as the peer's frame size and windows allow."""
        if not self.finished:
            self.conn.send(self, payloads)

    def finish(self, code: int = 0, message: str = "") -> None:
        """End the stream with ``grpc-status`` ``code`` once what is pending has gone."""
        if not self.finished:
            self.finished = True
            self.conn.finish(self, code, quote(message, safe=" ") if message else "")


@dataclass(frozen=True, slots=True)
class Method:
    """A served gRPC method: ``ext_proc`` (the fast path), or an asyncio servicer method
    taking (request iterator | request, context): ``stream`` or ``unary`` requests."""

    kind: str
    call: Callable[..., Any]
    decode: Callable[[bytes], Any]


class Connection(asyncio.Protocol):
    """One HTTP/2 connection (Envoy holds one per worker thread to each EPP).

    The framing, HPACK and flow control are native (``native/grpc_h2``, the ``h2``
    crate, polled in place): bytes read go in, gRPC events come out as
    ``(kind, stream_id, payload)``, and the bytes to write are taken once per read.
    """

    def __init__(self, server: H2Server) -> None:
        self.server = server
        # Streams past --max-streams get the EPP's own 503, so HTTP/2 allows more. The
        # reset limits follow from this number (native/grpc_h2, `Limits`): Envoy resetting
        # the streams of clients that went away never closes the connection under others.
        self.native = native.GrpcConnection(
            max_concurrent_streams=server.max_streams + 1000,
            max_message=server.max_message,
            window=_WINDOW,
            max_frame_size=_FRAME,
            max_header_list_size=_MAX_HEADER_LIST,
        )
        self.transport: asyncio.Transport | None = None
        #: The loop serving this connection, looked up once: each lookup is a getpid
        #: system call (CPython's fork check), 4 % of the EPP's CPU per request when
        #: done per message in a sandbox where system calls are dear.
        self.loop = asyncio.get_running_loop()
        self.streams: dict[int, Stream] = {}
        self._reading = False  # handling received events: one write at the end
        self._backlog: deque[tuple[int, int, bytes | None]] = deque()  # not yet handled
        self._paused = False  # reading paused while the backlog is handled in slices
        self.peer = ""
        #: Bytes charged to the body budget for this connection (:meth:`_account`).
        self.held = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.server.connections.add(self)
        self.flush()  # our SETTINGS

    def flush(self) -> None:
        data = self.native.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
        for kind, stream_id, _ in self.native.take_events():  # streams reset meanwhile
            if kind == native.CLOSED:
                self._drop(stream_id)
        self._account()

    def _account(self) -> None:
        """Charge the body budget with what this connection holds out of the streams'
        sight: partial messages and answers queued in the native layer, and what the
        transport has not written yet.

        Why: an echoed body leaves the budget when it is routed, but stays in memory
        until Envoy's windows let it out, which they do only as fast as Envoy's upstream
        reads. Uncounted, the budget let 70 bodies of 8 MiB pile up there (EPP peak
        574 MiB against a 128 MiB budget; docs/benchmarks/resilience.md has today's).
        Counted, new bodies get the budget's 503 while the old ones drain.
        """
        held = self.native.buffered()
        transport = self.transport
        if transport is not None:
            held += transport.get_write_buffer_size()
        if held != self.held:
            self.server.hold(held - self.held)
            self.held = held

    def resume_writing(self) -> None:
        """The transport's write buffer drained below its low-water mark."""
        self._account()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.native.receive(data)
        except ConnectionError as error:
            log.warning("gRPC connection from %s: protocol error (%s)", self.peer, error)
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
                self._event(*backlog.popleft())
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
            self.loop.call_soon(self._drain)
        elif self._paused:
            transport.resume_reading()
            self._paused = False

    def _event(self, kind: int, stream_id: int, payload: bytes | None) -> None:
        if kind == native.MESSAGE:
            stream = self.streams.get(stream_id)
            if stream is not None and stream.call is not None and payload is not None:
                stream.call.on_message(payload)
        elif kind == native.NEW:
            self._request(stream_id, payload or b"")
        elif kind == native.END:
            stream = self.streams.get(stream_id)
            if stream is not None and stream.call is not None:
                stream.call.on_end()
        elif kind == native.CLOSED:
            self._drop(stream_id)
        else:  # TOO_LARGE, COMPRESSED: the stream cannot go on
            stream = self.streams.get(stream_id)
            if stream is not None:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                if kind == native.COMPRESSED:
                    code = grpc.StatusCode.UNIMPLEMENTED
                self._fail(stream, _status(code), (payload or b"").decode())

    def _request(self, stream_id: int, path: bytes) -> None:
        stream = Stream(self, stream_id)
        self.streams[stream_id] = stream
        method = self.server.methods.get(path)
        if method is None:
            stream.finish(_status(grpc.StatusCode.UNIMPLEMENTED), f"unknown method {path!r}")
        elif method.kind == "ext_proc":
            stream.call = ExtProcCall(method.call(), stream)
        else:
            stream.call = AioCall(method, stream)

    def _fail(self, stream: Stream, code: int, message: str) -> None:
        stream.finish(code, message)
        if stream.call is not None:
            stream.call.on_close()

    def send(self, stream: Stream, payloads: tuple[bytes, ...]) -> None:
        self.native.send(stream.id, payloads)
        if not self._reading:
            self.flush()  # also delivers a reset the send found

    def finish(self, stream: Stream, code: int, message: str) -> None:
        """Our side has ended. A peer still sending may go on (what it sends is dropped):
        a reset would let a gRPC client discard the answer it has not read yet."""
        self.streams.pop(stream.id, None)
        self.native.finish(stream.id, code, message)
        if not self._reading:
            self.flush()

    def _drop(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            stream.finished = True
            if stream.call is not None:
                stream.call.on_close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._backlog.clear()
        for stream_id in list(self.streams):
            self._drop(stream_id)
        self.transport = None
        self.server.hold(-self.held)
        self.held = 0

    def goaway(self) -> None:
        self.native.goaway()
        self.flush()


class _Stepped:
    """A coroutine whose first step ran in place; awaited by the task it ran under.

    Its task's own first step comes later (the loop's next round): if the coroutine
    finished in place, that step just ends; if it suspended, the task carries on from
    the future it yielded.
    """

    __slots__ = ("coro", "done", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro, self.done, self.yielded = coro, False, None

    def __await__(self) -> Generator[Any, Any, Any]:
        if self.done:
            return None
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


async def _await(awaitable: _Stepped) -> Any:
    return await awaitable


def step_in_place(
    coro: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop | None = None
) -> tuple[asyncio.Task[Any], _Stepped, Any]:
    """Run ``coro`` up to its first suspension now, as the current task of a new task.

    Why: answering in the same loop round as the read (one write for every stream's
    answers) needs the step to run here, not in the loop's next round as a task's would;
    and code that wants a current task before it first suspends (aiohttp's timeouts,
    ``asyncio.timeout``) must find one, the task that will finish it. Python 3.12's eager
    task factory does this; on 3.11 the task is entered by hand, with asyncio's own
    ``_enter_task``/``_leave_task``. Returns the task, the step (``done`` if the coroutine
    finished in place) and its result. Raises what the coroutine raised in place.
    ``loop``, when the caller knows it, saves looking it up (a ``getpid`` system call:
    CPython's check for a fork).
    """
    loop = loop or asyncio.get_running_loop()
    step = _Stepped(coro)
    task = loop.create_task(_await(step))
    asyncio.tasks._enter_task(loop, task)
    try:
        step.yielded = coro.send(None)
    except StopIteration as stop:
        step.done = True
        return task, step, stop.value
    except BaseException:
        step.done = True
        raise
    finally:
        asyncio.tasks._leave_task(loop, task)
    return task, step, None


class ExtProcCall:
    """One ext-proc stream: ``ExtProcServer.Process``'s loop, driven by arriving messages.

    A message is answered in place: ``StreamState.handle_now`` for every one that does
    not route, and the one that routes as the current task of the task that finishes it
    if it suspends (the decision waits on the loop, e.g. flow control queueing it);
    later messages wait their turn.
    """

    def __init__(self, server: ExtProcServer, stream: Stream) -> None:
        self.server, self.stream = server, stream
        self.loop = stream.conn.loop
        self.state = StreamState(server, self.loop)
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
        try:
            result = self.state.handle_now(message)
            if result is None:  # it routes: under a task of its own, in case it waits
                task, step, result = step_in_place(self.state.handle_later(message), self.loop)
                if not step.done:  # the decision waits: the task finishes it
                    self.busy = task
                    task.add_done_callback(lambda task: self._resumed(task, message))
                    return
        except Exception:
            self._failed(message)
            return
        self._answered(result)

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
        if state.ends_with_pick:  # OK trailers in the same write: no response headers come
            self._finish()
            return
        if state.phase is Phase.BODY and state.deadline:
            if self.timer is None:
                self.timer = self.loop.call_at(state.deadline, self._timed_out)
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
        """The stream is over (finished, reset by Envoy or its connection gone).

        Unlinks it from its stream (a cycle otherwise): freed by reference counting, not
        by the garbage collector, whose collections would then run every few requests
        and, as their survivors grow, take tens of milliseconds (docs/epp.md, "Memory
        and overload").
        """
        if self.closed:
            return
        self.closed = True
        self.stream.call = None
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
        finally:
            stream.call = None  # a cycle otherwise (see ExtProcCall.on_close)

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
        task, step, _ = step_in_place(self._serve(self.method.call(self.request, self.context)))
        if not step.done:
            self.task = task

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
        #: What the connections hold is charged to the ext-proc server's body budget.
        self._budgets = [m.call for m in methods.values() if m.kind == "ext_proc"]
        self._budget: ExtProcServer | None = None

    def hold(self, delta: int) -> None:
        """The connections hold ``delta`` more bytes (fewer when negative): charged to
        the ext-proc server's body budget (``ExtProcServer.hold_in_transport``)."""
        if self._budget is None and self._budgets:
            self._budget = self._budgets[0]()
        if self._budget is not None:
            self._budget.hold_in_transport(delta)

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
