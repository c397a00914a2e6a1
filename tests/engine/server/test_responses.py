"""``/v1/responses`` through the real `openai` SDK on real engine processes (tiny model).

One engine serves the tiny model with a LoRA adapter (a second model, for the
``previous_response_id`` model check) and the auto tool choice (``responses_server`` in
conftest, shared with the LangChain tests); a second engine has a
store of 2 entries kept 2 s, for the store's bounds over HTTP. Random weights write
gibberish, so text checks are structural (the stream's deltas add up to the final text,
usage adds up); grammars (``text.format``, forced tool calls) give checkable output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from infergate.procs import ProcessGroup
from infergate.wire.responses import ROUTE_TAG_HEADER, route_tag, route_tag_of

from .conftest import MODEL, Server, _start

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
JSON_FORMAT: Any = {"format": {"type": "json_schema", "name": "forecast", "schema": SCHEMA}}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "Forecast",
               "parameters": SCHEMA}]  # fmt: skip
LONG = "Tell me about the weather in Paris and Oslo over the next few days, briefly. " * 3


@pytest.fixture
def server(responses_server: Server) -> Server:
    return responses_server


@pytest.fixture(scope="module")
def small_store(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[Server]:
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-small-store", tiny_model_dir, "--simulate",
            "--responses-api-store-max-entries", "2", "--responses-api-store-ttl", "2",
        )  # fmt: skip


@pytest.fixture(scope="module")
def no_store(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[Server]:
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-no-store", tiny_model_dir, "--simulate",
            "--no-enable-responses-api-store",
        )  # fmt: skip


def _events(stream: Any) -> list[Any]:
    return list(stream)


# -- plain, streamed, ids ------------------------------------------------------------------


def test_plain_create_and_retrieve(server: Server) -> None:
    client = server.client()
    res = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=8,
                                 temperature=0)  # greedy: the same answer every run
    assert res.object == "response" and res.model == MODEL
    assert route_tag_of(res.id) is not None
    assert res.status in ("completed", "incomplete")
    if res.status == "incomplete":
        assert res.incomplete_details is not None
        assert res.incomplete_details.reason == "max_output_tokens"
    [message] = res.output
    assert message.type == "message" and message.role == "assistant"
    assert res.output_text == message.content[0].to_dict()["text"]
    usage = res.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    again = client.responses.retrieve(res.id)
    assert again.status == res.status and again.output_text == res.output_text


def test_ids_carry_the_route_tag_the_epp_sent(server: Server) -> None:
    tag = route_tag("10.0.0.7:8000")
    http = server.http()
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    tagged = http.post("/v1/responses", json=body, headers={ROUTE_TAG_HEADER: tag}).json()
    assert route_tag_of(tagged["id"]) == tag
    own = route_tag_of(http.post("/v1/responses", json=body).json()["id"])
    bad = http.post("/v1/responses", json=body, headers={ROUTE_TAG_HEADER: "not-a-tag"}).json()
    assert own is not None and own != tag and route_tag_of(bad["id"]) == own


def test_stream_event_sequence(server: Server) -> None:
    stream = server.client().responses.create(
        model=MODEL, input="Hello", max_output_tokens=6, stream=True, temperature=0
    )
    events = _events(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete" if events[-1].response.status == "incomplete"
        else "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "".join(deltas) == events[-4].text
    assert final.usage is not None and final.usage.output_tokens <= 6
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


# -- structured output and tools -------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema(server: Server, stream: bool) -> None:
    client = server.client()
    args: Any = {"model": MODEL, "input": "Weather?", "max_output_tokens": 200, "text": JSON_FORMAT}
    if stream:
        events = _events(client.responses.create(**args, stream=True))
        assert events[-1].type == "response.completed"
        res = events[-1].response
    else:
        res = client.responses.create(**args)
    assert res.status == "completed"
    jsonschema.validate(json.loads(res.output_text), SCHEMA)
    assert res.text is not None and res.text.format.type == "json_schema"


def test_text_format_json_object(server: Server) -> None:
    res = server.client().responses.create(
        model=MODEL, input="JSON please", max_output_tokens=300, text={"format": {"type": "json_object"}}
    )
    if res.status == "completed":
        assert isinstance(json.loads(res.output_text), dict)
    else:  # a random model may still be inside the object at the limit
        assert res.output_text.lstrip().startswith("{")


def test_required_tool_call(server: Server) -> None:
    res = server.client().responses.create(
        model=MODEL, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=200,
    )  # fmt: skip
    calls = [item for item in res.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


def test_named_tool_call_streams_its_arguments(server: Server) -> None:
    events = _events(server.client().responses.create(
        model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=200, stream=True,
        tool_choice={"type": "function", "name": "get_weather"},
    ))  # fmt: skip
    kinds = [e.type for e in events]
    added = events[kinds.index("response.output_item.added")]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = events[kinds.index("response.function_call_arguments.done")]
    assert "".join(deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), SCHEMA)
    final = events[-1].response
    assert final.output[0].type == "function_call" and final.output[0].arguments == done.arguments


def test_function_call_output_continues_the_conversation(server: Server) -> None:
    client = server.client()
    first = client.responses.create(
        model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=200,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    call = first.output[0]
    assert call.type == "function_call"
    follow = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert follow.previous_response_id == first.id and follow.output
    # The same conversation given as items, without the store: the same prompt.
    manual = client.responses.create(
        model=MODEL, store=False, tools=TOOLS, max_output_tokens=4,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
    )  # fmt: skip
    assert manual.usage is not None and follow.usage is not None
    assert manual.usage.input_tokens == follow.usage.input_tokens


# -- previous_response_id -----------------------------------------------------------------------


def _prompt_len(server: Server, messages: list[dict[str, str]]) -> int:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    return int(server.http().post("/tokenize", json=body).json()["count"])


def test_three_turn_chain_rebuilds_the_conversation(server: Server) -> None:
    client = server.client()
    turns = [LONG, "And the day after?", "Thanks, one more?"]
    messages: list[dict[str, str]] = []
    previous: str | None = None
    for i, text in enumerate(turns):
        res = client.responses.create(
            model=MODEL, input=text, previous_response_id=previous, max_output_tokens=6,
            temperature=0,
        )
        messages.append({"role": "user", "content": text})
        assert res.usage is not None and res.usage.input_tokens == _prompt_len(server, messages)
        if i:
            assert res.previous_response_id == previous
            assert res.usage.input_tokens_details.cached_tokens > 0  # the earlier turns' KV
        messages.append({"role": "assistant", "content": res.output_text})
        previous = res.id


def test_instructions_are_not_carried_over(server: Server) -> None:
    client = server.client()
    first = client.responses.create(model=MODEL, input="Hi", instructions="Be terse.",
                                    max_output_tokens=3)  # fmt: skip
    second = client.responses.create(model=MODEL, input="More", previous_response_id=first.id,
                                     max_output_tokens=3)  # fmt: skip
    expected = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "More"}]  # fmt: skip
    assert second.usage is not None and second.usage.input_tokens == _prompt_len(server, expected)


def test_store_false_is_not_kept(server: Server) -> None:
    client = server.client()
    res = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    assert res.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(res.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, input="x", previous_response_id=res.id)
    assert error.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_previous_response_of_another_model_is_400(server: Server) -> None:
    client = server.client()
    res = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="adapter", input="x", previous_response_id=res.id)
    assert error.value.body["param"] == "previous_response_id"  # type: ignore[index]


# -- GET and cancel --------------------------------------------------------------------------------


def test_get_and_cancel_unknown_and_finished(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 48)
    with pytest.raises(openai.BadRequestError):
        client.responses.retrieve("nope")
    res = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.cancel(res.id)
    assert error.value.body["message"] == "Cannot cancel a synchronous response."  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + "0" * 48)


def test_cancel_stops_a_running_response(sim_server: Server) -> None:
    """On the simulated engine, which never ends an answer before its limit."""
    client = sim_server.client()
    sim_server.wait_idle()
    stream = client.responses.create(model=MODEL, input="Go on", max_output_tokens=1000,
                                     stream=True)  # fmt: skip
    events = iter(stream)
    created = next(events)
    assert created.type == "response.created"
    rid = created.response.id
    assert client.responses.retrieve(rid).status == "in_progress"
    with pytest.raises(openai.BadRequestError) as error:  # no continuing a running one
        client.responses.create(model=MODEL, input="x", previous_response_id=rid)
    assert error.value.body["param"] == "previous_response_id"  # type: ignore[index]
    cancelled = client.responses.cancel(rid)
    assert cancelled.status == "cancelled"
    rest = list(events)
    assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "cancelled"
    usage = rest[-1].response.usage
    assert usage is not None and usage.output_tokens < 1000
    assert client.responses.retrieve(rid).status == "cancelled"
    sim_server.wait_idle()  # the engine request was aborted and its KV blocks freed


def test_a_client_leaving_a_stream_aborts_it(sim_server: Server) -> None:
    sim_server.wait_idle()
    body = {"model": MODEL, "input": "Go on", "max_output_tokens": 1000, "stream": True}
    with sim_server.http() as http, http.stream("POST", "/v1/responses", json=body) as res:
        lines = res.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        next(line for line in lines if "response.output_text.delta" in line)
    sim_server.wait_idle()  # the engine request was aborted and its KV blocks freed
    with pytest.raises(openai.NotFoundError):  # nothing to continue from
        sim_server.client().responses.retrieve(created["response"]["id"])


# -- the store's bounds ----------------------------------------------------------------------------


def test_store_evicts_the_oldest_past_its_bound(small_store: Server) -> None:
    client = small_store.client()
    ids = [client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id
           for i in range(3)]  # fmt: skip
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, input="x", previous_response_id=ids[0])
    assert error.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for rid in ids[1:]:
        assert client.responses.retrieve(rid).id == rid


def test_store_forgets_after_its_ttl(small_store: Server) -> None:
    client = small_store.client()
    rid = client.responses.create(model=MODEL, input="hi", max_output_tokens=1).id
    assert client.responses.retrieve(rid).id == rid
    time.sleep(2.5)  # the engine was started with --responses-api-store-ttl 2
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


def test_without_a_store(no_store: Server) -> None:
    client = no_store.client()
    res = client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    assert res.to_dict()["store"] is False  # the default true cannot be honoured: off
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(res.id)
    with pytest.raises(openai.BadRequestError) as error:  # asked for explicitly: refused
        client.responses.create(model=MODEL, input="hi", store=True)
    assert error.value.body["param"] == "store"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=res.id)


# -- bad input ---------------------------------------------------------------------------------------

BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "mystery"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": ["just a string in a list"]}, "input[0]"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "many words " * 3000}, "input"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "top_p": 2}, "top_p"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "required", "text": JSON_FORMAT},
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": "{"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
    ({"input": "x", "priority": 1}, "priority"),  # the engine runs --scheduling-policy fcfs
    ({"input": "x", "priority": "high"}, "priority"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_field(server: Server, body: dict[str, Any],
                                           param: str) -> None:  # fmt: skip
    res = server.http().post("/v1/responses", json={"model": MODEL, **body})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param, res.text


def test_unknown_previous_response_is_404(server: Server) -> None:
    res = server.http().post("/v1/responses", json={
        "model": MODEL, "input": "x", "previous_response_id": "resp_" + "1" * 48})  # fmt: skip
    assert res.status_code == 404
    error = res.json()["error"]
    assert error["param"] == "previous_response_id" and "not found" in error["message"]


def test_get_with_stream_is_refused(server: Server) -> None:
    rid = server.client().responses.create(model=MODEL, input="x", max_output_tokens=1).id
    res = server.http().get(f"/v1/responses/{rid}", params={"stream": "true"})
    assert res.status_code == 400 and res.json()["error"]["param"] == "stream"


def test_bad_json_body_is_400(server: Server) -> None:
    res = httpx.post(f"{server.url}/v1/responses", content=b"{",
                     headers={"Authorization": "Bearer test-key"})  # fmt: skip
    assert res.status_code == 400
