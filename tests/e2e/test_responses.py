"""The Responses API through the real Envoy and EPP: ``responses.create`` (whole and
streamed) and a chained turn (``previous_response_id``) through the gateway; function tools
and ``text.format`` json_schema through it on a really computed tiny model.

One simulated engine, so the chained turn cannot miss the engine that stores the first:
sending a next turn back to the engine holding its conversation when there are several
is the EPP's part of issue 24 (the route tag in the id, :mod:`infergate.wire.responses`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from infergate.stack.local import LocalStack, StackSpec
from infergate.wire.responses import route_tag_of

from .conftest import _STACKS


def _one_engine(
    factory: pytest.TempPathFactory, tiny_model: Path, *, simulate: bool
) -> Iterator[LocalStack]:
    """One engine behind the real Envoy and EPP, registered for the e2e failure logs."""
    workdir = factory.mktemp("responses-stack")
    spec = StackSpec.on_free_ports(engines=1, model=tiny_model, served_model_name="tiny",
                                   simulate=simulate, workdir=workdir, start_timeout=180.0)  # fmt: skip
    with LocalStack(spec) as running:
        _STACKS.append(running)
        try:
            yield running
        finally:
            _STACKS.remove(running)


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    yield from _one_engine(tmp_path_factory, tiny_model, simulate=True)


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0,
                         timeout=60)  # fmt: skip


def test_create_and_chain_through_the_gateway(one_engine: LocalStack) -> None:
    client = _client(one_engine)
    first = client.responses.create(model="tiny", input="Hello", max_output_tokens=8)
    assert route_tag_of(first.id) is not None and first.output_text
    second = client.responses.create(model="tiny", input="And then?", max_output_tokens=8,
                                     previous_response_id=first.id)  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # The second prompt holds the first turn: its input, its answer, and the new input.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).id == second.id


def test_stream_through_the_gateway(one_engine: LocalStack) -> None:
    events: list[Any] = list(_client(one_engine).responses.create(
        model="tiny", input="Hello", max_output_tokens=8, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                             "response.incomplete")  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    """The tiny model really computed (grammars need logits; simulated mode has none)."""
    yield from _one_engine(tmp_path_factory, tiny_model, simulate=False)


WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip


def test_tools_and_json_schema_through_the_gateway(real_engine: LocalStack) -> None:
    """A forced function call and a json_schema answer keep their shape through Envoy and
    the EPP, and a tool's output chains back with previous_response_id. (The tiny model's
    weights are random: the schema bounds the city so the call closes within the budget.)"""
    client = _client(real_engine)
    called = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                     tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=160)  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1, called.output
    call = calls[0]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    answer = client.responses.create(
        model="tiny", previous_response_id=called.id, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert answer.previous_response_id == called.id
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    shaped = client.responses.create(
        model="tiny", input="Is it fine?", max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(shaped.output_text)["ok"], bool)
