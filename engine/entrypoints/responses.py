"""The one response-assembly path that completions and chat share.

An API turns its request into engine requests and one :class:`Choice` per engine
request; from there the skeleton is common: merge the engine streams, feed each output
to its choice, then either answer one JSON body (errors → 500, a client gone → 499) or
stream SSE chunks (``usage`` per chunk with ``continuous_usage_stats``, a final usage
chunk with ``include_usage``, ``[DONE]``). Usage counts each prompt once and every
choice's generated tokens, as vLLM sums them for ``n`` > 1 and prompt lists.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from infergate.engine.core.engine_core import RequestOutput

from .errors import APIError, error_body
from .serving_engine import run_to_end


class Choice(Protocol):
    """One choice of a response, built up from its engine request's outputs."""

    index: int
    prompt_index: int  # which prompt it answers (usage counts each prompt once)

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def last(self) -> RequestOutput | None: ...

    @property
    def completion_tokens(self) -> int: ...

    def add(self, out: RequestOutput) -> dict[str, Any] | None:
        """Take one engine output; the streamed choice object (None: nothing to send)."""
        ...

    def whole(self) -> dict[str, Any]:
        """The whole choice object, once every output was added."""
        ...


def usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """OpenAI usage: each prompt once (its first choice), every choice's output tokens."""
    first: dict[int, Choice] = {}
    for c in choices:
        first.setdefault(c.prompt_index, c)
    prompt = sum(c.num_prompt_tokens for c in first.values())
    cached = sum(c.last.num_cached_tokens for c in first.values() if c.last is not None)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def merge_streams(
    streams: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several requests' outputs as (stream index, output), as they come.

    Closing the merged stream closes every input, which aborts unfinished requests.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as error:  # surfaced to the consumer
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


@dataclass
class ResponsePlan:
    """Everything the skeleton needs from an API to answer one request."""

    base: dict[str, Any]  # id, object, created, model
    choices: list[Choice]  # one per engine stream, in stream order
    stream: AsyncGenerator[tuple[int, RequestOutput], None]
    include_usage: bool = False
    continuous_usage: bool = False
    chunk_object: str | None = None  # the streamed chunks' "object", when it differs
    preamble: list[dict[str, Any]] = field(default_factory=list)  # choices sent first
    # Whole answers only: which choices to keep, in order (best_of ranks them).
    select: Callable[[list[Choice]], list[Choice]] | None = None
    extra: Callable[[], dict[str, Any]] | None = None  # top-level fields of a whole body


async def whole_response(request: Request, plan: ResponsePlan) -> Response:
    outs = await run_to_end(request, plan.stream)
    if outs is None:
        return Response(status_code=499)  # nginx's "client closed request"
    for index, out in outs:
        if out.error is not None:
            raise APIError(500, out.error)
        plan.choices[index].add(out)
    kept = plan.select(plan.choices) if plan.select else plan.choices
    body = []
    for index, choice in enumerate(kept):
        choice.index = index
        body.append(choice.whole())
    extra = plan.extra() if plan.extra else {}
    # P/D (vLLM's field): a prefill held for a decode engine names its KV blocks here.
    held = [c.last.kv_transfer_params for c in plan.choices if c.last is not None]
    if any(held):
        extra["kv_transfer_params"] = next(p for p in held if p)
    return JSONResponse({**plan.base, "choices": body, "usage": usage(plan.choices), **extra})


def streaming_response(plan: ResponsePlan) -> StreamingResponse:
    base = {**plan.base, "object": plan.chunk_object or plan.base["object"]}

    def chunk(choice: dict[str, Any], live_usage: bool) -> str:
        body: dict[str, Any] = {**base, "choices": [choice]}
        if plan.include_usage:
            body["usage"] = usage(plan.choices) if live_usage and plan.continuous_usage else None
        return sse(body)

    async def events() -> AsyncIterator[str]:
        try:
            for first in plan.preamble:
                yield chunk(first, False)
            async for index, out in plan.stream:
                if out.error is not None:
                    yield sse(error_body(500, out.error))
                    break
                delta = plan.choices[index].add(out)
                if delta is not None:
                    yield chunk(delta, True)
            if plan.include_usage:
                yield sse({**base, "choices": [], "usage": usage(plan.choices)})
            yield "data: [DONE]\n\n"
        finally:
            await plan.stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


async def respond(request: Request, plan: ResponsePlan, stream: bool) -> Response:
    return streaming_response(plan) if stream else await whole_response(request, plan)


def stream_usage_flags(req: Any) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) from a request's ``stream_options``."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts and opts.continuous_usage_stats)
