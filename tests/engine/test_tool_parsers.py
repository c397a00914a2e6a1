"""Tool-call parsers on the texts models write (Hermes/Qwen, Llama 3 JSON), whole and
streamed piece by piece."""

from __future__ import annotations

import json

import pytest
from infergate.engine.tool_parsers import get_parser
from infergate.engine.tool_parsers.choice import plan_tools
from infergate.engine.tool_parsers.stream import ToolCallState

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

CASES = [
    ("hermes",
     'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
     "Sure.", [("f", {"a": 1}), ("g", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", '
     '"parameters": {"x": "y"}}', None, [("f", {}), ("g", {"x": "y"})]),
    ("llama3_json", "The answer is {not a call}", "The answer is {not a call}", []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_extract_whole(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got = get_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_pieces_match_whole(parser: str, text: str, content: str | None,
                                     calls: list) -> None:  # fmt: skip
    state = ToolCallState(plan_tools(TOOLS, "auto", None, True), get_parser(parser))
    streamed, deltas = "", []
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        c, d = state.feed(piece, i == len(pieces) - 1)
        streamed += c or ""
        deltas += d
    assert streamed.strip() == (content or "")
    assert [
        (d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas
    ] == calls
    assert [d["index"] for d in deltas] == list(range(len(calls)))


def test_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="mistral"):
        get_parser("mistral")


TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": {}}}]
REQUIRED_CASES = [
    # A closed array: every call, in order.
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]',
     None, [("f", {"a": 1}), ("g", {})]),
    # Not closed before max_tokens: stop at the first complete call, drop the rest.
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}, {"name": "f", '
     '"parameters": {"a": 2', None, [("f", {"a": 1})]),
    ('[{"name": "g", "parameters": {}}, ', None, [("g", {})]),
    # Cut inside the first call: no call, the text is the content.
    ('[{"name": "f", "parameters": {"a"', '[{"name": "f", "parameters": {"a"', []),
    ("[", "[", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), REQUIRED_CASES)
def test_required_with_parallel_calls_stops_at_the_first_complete_call_when_not_closed(
    text: str, content: str | None, calls: list
) -> None:
    plan = plan_tools(TWO_TOOLS, "required", None, True)
    assert plan.parallel and "maxItems" not in (plan.schema() or {})  # not bounded up front
    got_content, got = ToolCallState(plan, None).split(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    # Streamed, the same answer arrives once the output ends.
    state = ToolCallState(plan, None)
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    streamed: list = []
    streamed_content = ""
    for i, piece in enumerate(pieces):
        c, d = state.feed(piece, i == len(pieces) - 1)
        streamed_content += c or ""
        streamed += d
    assert (streamed_content or None) == content
    functions = [d["function"] for d in streamed]
    assert [(f["name"], json.loads(f["arguments"])) for f in functions] == calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_raw_control_characters_in_forced_arguments_become_strict_json(choice: object) -> None:
    """xgrammar's JSON string rule admits raw control characters (a random model writes
    them); the call is still recognised and its arguments are JSON a strict client reads."""
    plan = plan_tools(TOOLS, choice, False, True)
    args = '{"city": "Pa\x1eris\x07"}'
    text = f'[{{"name": "f", "parameters": {args}}}]' if choice == "required" else args
    content, calls = ToolCallState(plan, None).split(text)
    assert content is None and [c.name for c in calls] == ["f"]
    assert json.loads(calls[0].arguments) == {"city": "Pa\x1eris\x07"}
