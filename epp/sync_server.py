"""ext-proc on gRPC's synchronous server (``--grpc-server sync``): no event-loop hop per message.

Under grpc.aio every gRPC event (a message in, a message sent, the stream's end) is
picked up by grpc's poller thread and handed to the asyncio loop through a wake-up
socket, then resumes the stream's task: several thread hops and loop iterations per
message, most of the EPP's CPU per request (docs/architecture.md). Here each ext-proc
stream runs on a thread of grpc's own pool, which grpc wakes directly, and drives the
same per-stream state machine (:class:`~infergate.epp.server.StreamState`) in that
thread.

The EPP's state (datastore, scheduler, prefix index, flow control, metrics) belongs to
the asyncio loop, which still runs the collectors, subscriptions and timers. Both
sides take :class:`LoopLock`: the loop holds it except while it waits for events, a
stream thread holds it while it handles one message, so EPP code never runs on two
threads at once. A coroutine that really waits (flow control queueing a request) is
finished on the loop, the stream thread waiting without the lock.

EDS stays an asyncio servicer: its streams are served here through :func:`aio_stream`
(a few messages per endpoint change, so the hops do not matter).
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from infergate.epp.eds import EndpointDiscovery
from infergate.epp.server import ExtProcServer, ObserverState, Phase, StreamState, immediate

log = logging.getLogger("infergate.epp.sync_server")

T = TypeVar("T")
_END = object()


class LoopLock:
    """One lock for the EPP's state (see the module docstring); ``with lock:`` takes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *_: object) -> None:
        self._lock.release()


class LockedLoop(asyncio.SelectorEventLoop):
    """An asyncio loop that holds :attr:`lock` while it runs, except while it selects."""

    def __init__(self) -> None:
        self.lock = LoopLock()
        lock = self.lock

        class Selector(selectors.DefaultSelector):
            def select(self, timeout: float | None = None) -> Any:
                lock.__exit__()
                try:
                    return super().select(timeout)
                finally:
                    lock.__enter__()

        super().__init__(Selector())

    def run_forever(self) -> None:
        with self.lock:
            super().run_forever()

    def wake(self) -> None:
        """Wake the loop if a stream thread left it callbacks (it may be in ``select``)."""
        if self._ready:  # type: ignore[attr-defined]
            self._write_to_self()  # type: ignore[attr-defined]


class _Resumed:
    """The rest of a coroutine that suspended on a loop future, to be awaited on the loop."""

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


class SyncExtProc(pb_grpc.ExternalProcessorServicer):
    """``ExtProcServer.Process`` on a thread per stream (see the module docstring)."""

    def __init__(self, server: ExtProcServer, loop: LockedLoop) -> None:
        self.server, self.loop, self.lock = server, loop, loop.lock

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` here, under the lock; what it still awaits, on the loop."""
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            return stop.value
        future = asyncio.run_coroutine_threadsafe(_await(_Resumed(coro, yielded)), self.loop)
        self.lock.__exit__()
        try:
            return future.result()
        finally:
            self.lock.__enter__()

    def Process(
        self, request_iterator: Iterator[pb.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ProcessingResponse]:
        asyncio.events._set_running_loop(self.loop)  # EPP code reads the loop's clock
        server = self.server
        with self.lock:
            state = StreamState(server)
            server.active_streams += 1
        observer: ObserverState | None = None
        try:
            if server.active_streams > server.limits.max_streams:
                with self.lock:
                    server.count("overloaded_503")
                state.phase = Phase.DONE
                if next(request_iterator, None) is not None:
                    yield immediate(503, "the endpoint picker has too many requests open; retry")
                return
            while True:
                try:
                    message = next(request_iterator, None)
                except DecodeError as error:
                    log.warning(
                        "ext-proc stream from %s: corrupt frame (%s)", context.peer(), error
                    )
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "corrupt ProcessingRequest")
                if message is None:
                    return
                with self.lock:
                    if observer is not None:
                        observer.handle(message)
                        continue
                    if message.observability_mode and state.phase is Phase.HEADERS:
                        observer = ObserverState(server)
                        observer.handle(message)
                        continue
                    responses = self._handle(state, message)
                    self.loop.wake()
                yield from responses
        finally:
            with self.lock:
                if observer is not None:
                    observer.end(complete=False)
                else:
                    state.close()
                server.active_streams -= 1

    def _handle(
        self, state: StreamState, message: pb.ProcessingRequest
    ) -> list[pb.ProcessingResponse]:
        try:
            return self._run(state.handle(message))
        except Exception:
            log.exception("ext-proc stream failed while handling %s", message.WhichOneof("request"))
            self.server.count("error")
            state.phase = Phase.DONE
            return [immediate(500, "the endpoint picker failed on this request")]


def aio_stream(
    method: Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]],
    loop: asyncio.AbstractEventLoop,
) -> Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]:
    """A stream-stream asyncio servicer method as a synchronous one (run on ``loop``)."""

    def handler(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        async def incoming() -> AsyncIterator[Any]:
            while True:
                item = await loop.run_in_executor(None, next, requests, _END)
                if item is _END:
                    return
                yield item

        stream = method(incoming(), context)
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(_next(stream), loop).result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(_close(stream), loop)

    return handler


async def _next(stream: AsyncIterator[Any]) -> Any:
    return await stream.__anext__()


async def _close(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class SyncEds(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """The asyncio EDS servicer (epp/eds.py) on the synchronous server."""

    def __init__(self, eds: EndpointDiscovery, loop: asyncio.AbstractEventLoop) -> None:
        self.StreamEndpoints = aio_stream(eds.StreamEndpoints, loop)


def sync_server(max_streams: int, options: list[tuple[str, Any]]) -> grpc.Server:
    """grpc's synchronous server with one pool thread per concurrent stream. A few more
    threads than ``max_streams``: the stream past it gets the EPP's own 503 and the EDS
    and health streams always have one."""
    workers = max_streams + 16
    return grpc.server(
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ext-proc"),
        options=options,
        maximum_concurrent_rpcs=workers,
    )
