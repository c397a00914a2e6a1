"""Tool calling through the real `openai` client on the real tiny model.

``required`` and a named function are forced by a JSON-schema grammar, so even random
weights return valid calls; ``auto`` runs on an engine started with vLLM's
``--enable-auto-tool-choice --tool-call-parser hermes``, where a grammar makes the tiny
model write Hermes markup for the parser to find.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from infergate.procs import ProcessGroup

from .conftest import MODEL, Server, _start

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def _check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        jsonschema.validate(args, WEATHER)
    else:
        assert name == "ping" and args == {}


@pytest.fixture(scope="module")
def auto_server(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[Server]:
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-tools", tiny_model_dir,
            "--device", "cpu", "--dtype", "float32",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        )  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_required_returns_valid_calls(real_server: Server, seed: int) -> None:
    res = real_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
        seed=seed, parallel_tool_calls=False,
    )  # fmt: skip
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and choice.message.content is None
    for call in calls:
        assert call.type == "function" and call.id
        _check_call(call.function.name, call.function.arguments)


def test_named_function_returns_its_arguments(real_server: Server) -> None:
    res = real_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=200, n=2
    )
    for choice in res.choices:
        assert choice.finish_reason == "stop"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        _check_call("get_weather", call.function.arguments)  # type: ignore[union-attr]


def _stream_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None, str]:
    """Reassemble streamed tool-call deltas as OpenAI clients do (by index)."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += d.id or ""
                if d.function is not None:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_streamed_tool_call_deltas(real_server: Server, tool_choice: Any) -> None:
    stream = real_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
        stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    calls, finish, _ = _stream_calls(stream)
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert len(calls) == 1 and calls[0]["id"]
    _check_call(calls[0]["name"], calls[0]["arguments"])


def test_tool_choice_none_and_history_with_tool_messages(real_server: Server) -> None:
    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 4}'},
    ]  # fmt: skip
    res = real_server.client().chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert res.choices[0].message.tool_calls is None
    assert res.choices[0].message.content


def test_auto_needs_the_server_flag(real_server: Server) -> None:
    for choice in ("auto", None):
        extra: dict[str, Any] = {} if choice is None else {"tool_choice": choice}
        with pytest.raises(openai.BadRequestError) as info:
            real_server.client().chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=5, **extra
            )
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in body["message"]


HERMES = (
    'root ::= "Let me check. <tool_call>\\n{\\"name\\": \\"get_weather\\", '
    '\\"arguments\\": {\\"city\\": \\"" ("Oslo" | "Lima") "\\", \\"days\\": " [1-7] '
    '"}}\\n</tool_call>"'
)


def test_auto_parses_hermes_calls_stream_and_not(auto_server: Server) -> None:
    client = auto_server.client()
    res = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300, temperature=0,
        extra_body={"guided_grammar": HERMES},
    )  # fmt: skip
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls or []
    _check_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300, temperature=0, stream=True,
        extra_body={"guided_grammar": HERMES},
    )  # fmt: skip
    calls, finish, content = _stream_calls(stream)
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert "<tool_call" not in content
    _check_call(calls[0]["name"], calls[0]["arguments"])
    # Without markup, auto returns plain content and no calls.
    res = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert res.choices[0].message.tool_calls in (None, [])
    assert res.choices[0].finish_reason in ("stop", "length")


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_requests_are_400(
    real_server: Server, extra: dict[str, Any], param: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        real_server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=stream, extra_body=extra
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


def test_simulated_mode_refuses_forced_tools(sim_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sim_server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=5
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_required_with_parallel_calls_always_answers_with_a_call(
    real_server: Server, seed: int
) -> None:
    """Parallel calls allowed (the default): the tiny model may keep adding calls until
    max_tokens without closing the array; the answer then stops at the first complete
    call instead of returning none."""
    res = real_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
        seed=seed,
    )  # fmt: skip
    choice = res.choices[0]
    calls = choice.message.tool_calls or []
    assert calls and choice.message.content is None
    for call in calls:
        assert call.type == "function"
        _check_call(call.function.name, call.function.arguments)
    if choice.finish_reason == "length":
        assert len(calls) == 1
    else:
        assert choice.finish_reason == "tool_calls"
