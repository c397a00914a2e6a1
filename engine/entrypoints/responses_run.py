"""One running response: engine outputs → Responses events, the final Response object,
and the store entry kept up to date (so GET sees it finish and cancel can stop it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from infergate.engine.core.engine_core import RequestOutput
from infergate.engine.tool_parsers.stream import ToolCallState

from .response_store import ResponseStore, StoredResponse
from .responses_output import Event, OutputBuilder

#: The closing event per final status (OpenAI's names; a cancelled run ends incomplete).
TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


async def until_cancelled(
    stream: AsyncGenerator[RequestOutput, None], cancel: asyncio.Event
) -> AsyncGenerator[RequestOutput, None]:
    """The stream's outputs until it ends or ``cancel`` is set; closing the stream early
    aborts the engine request, which frees its KV blocks."""
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        while not cancel.is_set():
            step = asyncio.ensure_future(anext(stream))
            await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                return
            try:
                out = step.result()
            except StopAsyncIteration:
                return
            yield out
            if out.finished:
                return
    finally:
        waiter.cancel()
        await stream.aclose()


class ResponseRun:
    def __init__(self, base: dict[str, Any], tools: ToolCallState, prompt_tokens: int) -> None:
        self.base, self.prompt_tokens = base, prompt_tokens
        self.tools = tools if tools.active else None
        self.builder = OutputBuilder()
        self.last: RequestOutput | None = None
        self.error: str | None = None
        self.response: dict[str, Any] = self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """The Response object while it runs (no output yet, no usage)."""
        return {**self.base, "status": "in_progress", "output": [], "usage": None}

    async def events(self, stream: AsyncGenerator[RequestOutput, None],
                     entry: StoredResponse | None, store: ResponseStore | None) -> AsyncGenerator[Event, None]:  # fmt: skip
        """Every event of the response, from ``response.created`` to its closing event."""
        b = self.builder
        cancel = entry.cancel if entry is not None else asyncio.Event()
        outputs = until_cancelled(stream, cancel)
        finished = False
        try:
            yield b.event("response.created", response=self.snapshot())
            yield b.event("response.in_progress", response=self.snapshot())
            async for out in outputs:
                if out.error is not None:
                    self.error = out.error
                    break
                self.last = out
                for event in b.feed(*self.split(out)):
                    yield event
            status = self.status(cancel.is_set())
            for event in b.finish("completed" if status == "completed" else "incomplete"):
                yield event
            self.response = self.final(status)
            if entry is not None and store is not None:
                entry.response = self.response
                store.put(self.base["id"], entry)  # refreshes its TTL
            finished = True
            yield b.event(TERMINAL[status], response=self.response)
        finally:
            await outputs.aclose()  # closes the engine stream: aborts it if unfinished
            if not finished and entry is not None and store is not None:
                store.discard(self.base["id"])  # the client left: nothing to continue from

    def split(self, out: RequestOutput) -> tuple[str | None, list[dict[str, Any]]]:
        """(content delta, chat tool-call deltas) of one output."""
        if self.tools is None:
            return out.new_text, []
        return self.tools.feed(out.new_text, out.finished)

    def status(self, cancelled: bool) -> str:
        if self.error is not None:
            return "failed"
        if cancelled:
            return "cancelled"
        if self.last is not None and self.last.finish_reason == "length":
            return "incomplete"
        return "completed"

    def final(self, status: str) -> dict[str, Any]:
        last = self.last
        output_tokens = last.num_output_tokens if last is not None else 0
        cached = last.num_cached_tokens if last is not None else 0
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        error = {"code": "server_error", "message": self.error} if self.error else None
        return {
            **self.base, "status": status, "output": self.builder.items,
            "incomplete_details": incomplete, "error": error,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + output_tokens,
            },
        }  # fmt: skip
