"""Real clients against a real instruct model: SmolLM2-135M-Instruct (GGUF, fetched from
PyPI) served by ``infergate engine serve``, on CPU.

Checks are loose on purpose (schema-valid, the right tool, the expected city), never
exact strings. SmolLM2's own chat template has no tools; smollm2_tools.jinja adds a
Hermes-style tool prompt (``<tool_call>{...}</tool_call>``), parsed by ``hermes``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from infergate.procs import ProcessGroup

from .conftest import API_KEY, MODEL, Server, _start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


@tool
def get_time(city: str) -> str:
    """Get the current local time in a city."""
    return f"noon in {city}"


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf: Path, infergate_cli: list[str]) -> Iterator[Server]:
    template = Path(__file__).with_name("smollm2_tools.jinja")
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-smollm2", smollm2_gguf,
            "--device", "cpu", "--dtype", "float32", "--chat-template", str(template),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        )  # fmt: skip


def _chat(server: Server) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY,  # type: ignore[arg-type]
                      max_retries=0, max_completion_tokens=60, temperature=0)  # fmt: skip


def test_openai_sdk_stream_answers(smollm2_server: Server) -> None:
    stream = smollm2_server.client().chat.completions.create(
        model=MODEL, stream=True, max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert len(chunks) > 3, "the answer must arrive in pieces"
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("question", "city"),
    [
        ("Where is the Eiffel Tower? Answer in JSON with the city and the country.", "paris"),
        ("I flew to Tokyo, Japan last week. Extract the city and country as JSON.", "tokyo"),
    ],
)
def test_json_schema_output_is_valid_and_meaningful(
    smollm2_server: Server, question: str, city: str
) -> None:
    response = smollm2_server.client().chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": question}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": PLACE, "strict": True}},
    )  # fmt: skip
    place = json.loads(response.choices[0].message.content or "")
    jsonschema.validate(place, PLACE)
    assert city in place["city"].lower()


@pytest.mark.parametrize(
    ("question", "tool_name", "city"),
    [
        ("What's the weather like in Paris today?", "get_weather", "Paris"),
        ("What time is it in Tokyo right now?", "get_time", "Tokyo"),
    ],
)
def test_langchain_model_picks_the_tool(
    smollm2_server: Server, question: str, tool_name: str, city: str
) -> None:
    """tool_choice=required: the grammar forces a call, the model chooses which of the two
    tools and its arguments."""
    llm = _chat(smollm2_server).bind_tools(
        [get_weather, get_time], tool_choice="required", parallel_tool_calls=False
    )
    (call,) = llm.invoke(question).tool_calls
    assert (call["name"], call["args"]) == (tool_name, {"city": city})


AUTO_TOOL_QUESTIONS = [
    ("What's the weather like in Paris today?", "get_weather", "Paris"),
    ("What time is it in Tokyo?", "get_time", "Tokyo"),
    ("How is the weather in Berlin?", "get_weather", "Berlin"),
    ("What is the local time in London?", "get_time", "London"),
]


def test_langchain_auto_model_chooses_offered_tools(smollm2_server: Server) -> None:
    """tool_choice=auto: nothing forces a call, yet with the template's one worked example
    the model calls the right tool for each weather or time question. Off-topic questions
    may be answered in prose or with a call; a call can only name an offered tool (the
    structural tag), where unconstrained the 135M model invents names such as
    ``get_total_score``."""
    llm = _chat(smollm2_server).bind_tools([get_weather, get_time], tool_choice="auto")
    for question, tool_name, city in AUTO_TOOL_QUESTIONS:
        (call,) = llm.invoke(question).tool_calls
        assert (call["name"], call["args"]) == (tool_name, {"city": city}), question
    for question in ("What is two plus two?", "Write a haiku about the sea."):
        message = llm.invoke(question)
        for call in message.tool_calls:
            assert call["name"] in ("get_weather", "get_time")
            assert isinstance(call["args"].get("city"), str)
        if not message.tool_calls:
            assert str(message.content).strip()
