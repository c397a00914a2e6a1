"""The async client of the engine core, with the step loop on its own thread.

As vLLM splits AsyncLLM (the API side) from EngineCore (the busy loop), the server only
talks to :class:`AsyncEngine` — ``generate`` (an async stream of outputs), ``abort``,
``call`` — and never touches the core, which lives on a dedicated thread fed by a
command queue. The loop blocks when idle and otherwise steps back-to-back; outputs of a
step reach the event loop in one ``call_soon_threadsafe``. Moving the core into another
process later only replaces the queue and this class's internals.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from infergate.engine.completion_events import CURRENT as CURRENT_USAGE
from infergate.engine.completion_events import Usage
from infergate.engine.core.engine_core import EngineCore, RequestOutput
from infergate.engine.core.request import Request

log = logging.getLogger(__name__)
T = TypeVar("T")

_Command = tuple[str, Any]


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead: str | None = None  # why the step loop stopped, if it did
        self.log_interval = 10.0  # seconds between stats lines while there is traffic

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join(timeout=5.0)
            self._thread = None

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    # -- API --------------------------------------------------------------------------
    def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        """Submit ``request`` now and return the stream of its outputs.

        Submitting before the caller starts iterating lets the engine work while the
        HTTP response is being set up; closing the stream early aborts the request.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._commands.put(("add", request))
        # The HTTP request's completion record (when one is reported) sums this request.
        usage = CURRENT_USAGE.get()
        if usage is not None:
            usage.submitted(len(request.prompt_token_ids))
        return self._outputs(request.request_id, stream, usage, id(request.prompt_token_ids))

    async def _outputs(
        self,
        request_id: str,
        stream: asyncio.Queue[RequestOutput],
        usage: Usage | None = None,
        prompt_id: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                if finished and usage is not None:
                    usage.add(
                        prompt_id, out.num_prompt_tokens, out.num_output_tokens,
                        out.num_cached_tokens,
                    )  # fmt: skip
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(core)`` on the engine thread (between steps) and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn(core)`` for the engine thread from any thread; its future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        return future

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        stats = (time.monotonic(), 0, 0)
        try:
            while True:
                if time.monotonic() - stats[0] >= self.log_interval:
                    line, new = core.stats_line(stats)
                    if new[1:] != stats[1:] or core.has_work():
                        log.info("%s", line)
                    stats = new
                block = not core.has_work()
                while True:
                    try:
                        # Idle: wake up now and then anyway, for the periodic log line.
                        command = self._commands.get(block=block, timeout=self.log_interval)
                    except queue.Empty:
                        break
                    if command[0] == "stop":
                        return
                    self._handle(command)
                    block = not core.has_work()
                try:
                    outputs = core.step()
                except Exception as error:
                    log.exception("engine step failed; failing all requests")
                    self.dead = f"engine step failed: {error!r}"
                    self._deliver(core.fail_all(self.dead))
                    return
                if outputs:
                    self._deliver(outputs)
        except Exception as error:  # a bug outside the step: say so, fail what is left
            log.exception("engine loop crashed")
            self.dead = f"engine loop crashed: {error!r}"

    def _handle(self, command: _Command) -> None:
        kind, arg = command
        if kind == "add":
            try:
                self.core.add_request(arg)
            except Exception as error:  # refuse this request, keep serving the others
                log.exception("could not add request %s", arg.request_id)
                self._deliver(
                    [RequestOutput(arg.request_id, [], "", True, "abort", error=repr(error))]
                )
        elif kind == "abort":
            self.core.abort(arg)
        elif kind == "call":
            fn, future = arg
            try:
                future.set_result(fn(self.core))
            except Exception as error:
                future.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # event loop closed during shutdown
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            # A finished request's queue is dropped here too, in case its stream was
            # never iterated (client gone before the response started).
            stream = (self._streams.pop if out.finished else self._streams.get)(
                out.request_id, None
            )
            if stream is not None:
                stream.put_nowait(out)
