"""Responses output assembly without an engine: engine outputs (as the engine yields them)
through :class:`ResponseRun` → the event sequence and the output items, for text, for an
``auto`` tool call found by the hermes parser after some text, and for a cut answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from infergate.engine.core.engine_core import RequestOutput
from infergate.engine.entrypoints.response_store import ResponseStore, StoredResponse
from infergate.engine.entrypoints.responses_run import ResponseRun
from infergate.engine.tool_parsers import get_parser
from infergate.engine.tool_parsers.choice import plan_tools
from infergate.engine.tool_parsers.stream import ToolCallState

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


async def _outputs(pieces: list[str], reason: str) -> AsyncGenerator[RequestOutput, None]:
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield RequestOutput("r", [i], piece, last, reason if last else None,
                            num_prompt_tokens=5, num_output_tokens=i + 1, num_cached_tokens=2)  # fmt: skip


def _run(pieces: list[str], reason: str = "stop", tools: bool = False,
         store: ResponseStore | None = None) -> tuple[ResponseRun, list[dict[str, Any]]]:  # fmt: skip
    plan = plan_tools(TOOLS if tools else None, None, None, True)
    state = ToolCallState(plan, get_parser("hermes"))
    run = ResponseRun({"id": "resp_x", "object": "response"}, state, 5)
    entry = StoredResponse("tiny", run.snapshot(), []) if store is not None else None
    if store is not None and entry is not None:
        store.put("resp_x", entry)

    async def collect() -> list[dict[str, Any]]:
        return [e async for e in run.events(_outputs(pieces, reason), entry, store)]

    return run, asyncio.run(collect())


def test_text_events_and_usage() -> None:
    _, events = _run(["Hel", "lo"])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7,
    }  # fmt: skip


def test_auto_tool_call_after_text() -> None:
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    run, events = _run(["Sure. ", call[:10], call[10:]], tools=True)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == 2
    assert "response.function_call_arguments.done" in kinds
    message, fn = events[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Sure. "
    assert fn["type"] == "function_call" and fn["name"] == "f"
    assert json.loads(fn["arguments"]) == {"a": 1} and fn["call_id"].startswith("call_")
    assert run.response["status"] == "completed"


def test_an_empty_answer_is_an_empty_message() -> None:
    _, events = _run([""])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_cut_answer_is_incomplete_and_stored() -> None:
    store = ResponseStore()
    run, events = _run(["a", "b"], reason="length", store=store)
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    held = store.get("resp_x")
    assert held is not None and held.status == "incomplete" and held.response is run.response
