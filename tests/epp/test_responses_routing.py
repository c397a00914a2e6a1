"""Responses API and Anthropic Messages bodies in the EPP: their parsers, prefix hashing
over a conversation's turns, and previous-response affinity (the scorer, its place in the
default profile, and the route tag the Director sends)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from infergate.epp.config import DEFAULT_CONFIG_YAML, parse_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.requestcontrol.requests import BadRequest, api_of, parse_body
from infergate.epp.scheduling.plugins import REGISTRY, PluginContext
from infergate.epp.scheduling.plugins.prefix import prompt_bytes
from infergate.epp.scheduling.plugins.response_affinity import HOLDER
from infergate.epp.scheduling.prefix_index import block_hashes
from infergate.epp.scheduling.scheduler import Scheduler
from infergate.epp.types import (
    ANTHROPIC_MESSAGES_API,
    CHAT_API,
    RESPONSES_API,
    CycleState,
    Endpoint,
    InferenceRequest,
)

from infergate.wire.responses import ROUTE_TAG_HEADER, make_response_id, route_tag

from .conftest import Stream, body, headers, response_body, response_headers, set_headers

RESPONSES = {":method": "POST", ":path": "/v1/responses", "content-type": "application/json"}
MESSAGES = {":method": "POST", ":path": "/v1/messages", "content-type": "application/json"}


def parse(payload: dict[str, Any] | bytes, path: str = "/v1/responses") -> InferenceRequest:
    request = InferenceRequest("r", {":path": path})
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    parse_body(raw, request)
    return request


def hashes(request: InferenceRequest) -> list[int]:
    return block_hashes(request.model, request.cache_salt, prompt_bytes(request), 64, 1000)


# --- the Responses parser ------------------------------------------------------------------

SYSTEM = "You are a terse assistant. " * 20
TURN_1 = "What is the capital of France? Answer in one word and explain nothing else. " * 3
ANSWER = "Paris."
TURN_2 = "And of Italy? " * 10


def test_api_is_picked_by_path() -> None:
    assert api_of("/v1/responses") == RESPONSES_API
    assert api_of("/v1/responses?stream=true") == RESPONSES_API
    assert api_of("/v1/messages") == ANTHROPIC_MESSAGES_API
    assert api_of("/v1/chat/completions") == CHAT_API
    assert api_of("/v1/responses/resp_x") == ""
    chat = parse(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"
    )
    assert chat.api == CHAT_API and chat.prompt_text == "hi"


def test_two_turns_of_a_stateless_conversation_share_their_prefix_blocks() -> None:
    """Turn 2 repeats turn 1 (string input) as items, the assistant's output item with
    its id and status, then a new message: turn 1's blocks are turn 2's leading blocks."""
    first = parse({"model": "m", "instructions": SYSTEM, "input": TURN_1, "max_output_tokens": 8})
    second = parse(
        {
            "model": "m",
            "instructions": SYSTEM,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": TURN_1}]},
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": ANSWER, "annotations": []}],
                },
                {"type": "message", "role": "user", "content": TURN_2},
            ],
        }
    )
    assert first.api == second.api == RESPONSES_API
    assert first.max_tokens == 8 and first.previous_response_id == ""
    a, b = hashes(first), hashes(second)
    assert len(a) >= 4 and len(b) > len(a)
    assert b[: len(a) - 1] == a[:-1]  # all but turn 1's last (partial) block
    lines = second.prompt_text.split("\n")
    assert [json.loads(line)["role"] for line in lines] == ["system", "user", "assistant", "user"]
    assert json.loads(lines[2]) == {"role": "assistant", "content": ANSWER}
    assert second.prompt_tokens_estimate == len(second.prompt_text) // 4


def test_tool_items_are_part_of_the_prefix() -> None:
    call = {
        "type": "function_call",
        "call_id": "c1",
        "name": "weather",
        "arguments": '{"city":"Paris"}',
    }
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    request = parse(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "weather?"},
                {**call, "id": "fc_1", "status": "completed"},
                output,
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "item_reference", "id": "msg_9"},
                {"type": "some_future_item", "data": [1, 2]},
            ],
        }
    )
    lines = [json.loads(line) for line in request.prompt_text.split("\n")]
    assert lines[1] == {
        "type": "function_call",
        "call_id": "c1",
        "name": "weather",
        "arguments": '{"city":"Paris"}',
    }
    assert lines[2] == {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    assert len(lines) == 3  # reasoning, references and unknown items carry no prefix text


def test_previous_response_id_is_read() -> None:
    rid = make_response_id(route_tag("10.0.0.2:8000"))
    request = parse({"model": "m", "input": "next", "previous_response_id": rid, "stream": True})
    assert request.previous_response_id == rid and request.stream
    assert (
        parse({"model": "m", "input": "x", "previous_response_id": None}).previous_response_id == ""
    )


BAD_RESPONSES: dict[str, tuple[dict[str, Any], str]] = {
    "input a number": ({"model": "m", "input": 3}, "input"),
    "input an object": ({"model": "m", "input": {"role": "user"}}, "input"),
    "item not an object": ({"model": "m", "input": ["hi"]}, "input[0]"),
    "role not a string": ({"model": "m", "input": [{"role": 1, "content": "x"}]}, "input[0]"),
    "content a number": ({"model": "m", "input": [{"role": "user", "content": 5}]}, "input[0]"),
    "part text a number": (
        {"model": "m", "input": [{"role": "user", "content": [{"text": 5}]}]},
        "input[0]",
    ),
    "arguments an object": (
        {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": {}}]},
        "input[0]",
    ),
    "output a number": (
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": 1}]},
        "input[0]",
    ),
    "type a number": ({"model": "m", "input": [{"type": 7}]}, "input[0]"),
    "instructions a list": ({"model": "m", "input": "x", "instructions": ["a"]}, "instructions"),
    "previous id a number": (
        {"model": "m", "input": "x", "previous_response_id": 5},
        "previous_response_id",
    ),
    "negative max_output_tokens": (
        {"model": "m", "input": "x", "max_output_tokens": -1},
        "max_output_tokens",
    ),
    "stream a string": ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
}


@pytest.mark.parametrize("case", BAD_RESPONSES.values(), ids=BAD_RESPONSES.keys())
def test_malformed_responses_bodies_name_the_field(case: tuple[dict[str, Any], str]) -> None:
    payload, param = case
    with pytest.raises(BadRequest) as caught:
        parse(payload)
    assert caught.value.param == param


def test_deeply_nested_item_is_a_400() -> None:
    deep = b'{"model":"m","input":[{"role":"user","content":' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    with pytest.raises(BadRequest):
        parse(deep)


# --- the Anthropic Messages parser ---------------------------------------------------------


def test_anthropic_system_and_messages_are_hashed_in_order() -> None:
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    turn_1 = [{"role": "user", "content": TURN_1}]
    first = parse(
        {"model": "m", "max_tokens": 16, "system": system, "messages": turn_1}, "/v1/messages"
    )
    second = parse(
        {
            "model": "m",
            "max_tokens": 16,
            "system": SYSTEM,  # the same system prompt, as a string and without the marker
            "messages": [
                *turn_1,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": ANSWER},
                        {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "it"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "Rome"},
                        {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                        {"type": "text", "text": TURN_2},
                    ],
                },
            ],
        },
        "/v1/messages",
    )
    assert first.api == ANTHROPIC_MESSAGES_API and first.max_tokens == 16
    a, b = hashes(first), hashes(second)
    assert len(a) >= 4 and b[: len(a) - 1] == a[:-1]
    lines = [json.loads(line) for line in second.prompt_text.split("\n")]
    assert [line["role"] for line in lines] == ["system", "user", "assistant", "user"]
    assert "lookup" in lines[2]["content"] and lines[3]["content"] == "Rome" + TURN_2


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"model": "m", "max_tokens": 1}, "messages"),
        ({"model": "m", "max_tokens": 1, "messages": ["hi"]}, "messages[0]"),
        (
            {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
        ),
        ({"model": "m", "max_tokens": 1, "system": 3, "messages": []}, "system"),
        (
            {
                "model": "m",
                "max_tokens": 1,
                "system": [{"type": "text", "text": 3}],
                "messages": [],
            },
            "system",
        ),
    ],
)
def test_malformed_anthropic_bodies_name_the_field(payload: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse(payload, "/v1/messages")
    assert caught.value.param == param


# --- the response-affinity scorer and filter ----------------------------------------------------------

ENDPOINTS = [Endpoint(f"10.0.0.{i}", 8000) for i in range(1, 5)]


def context(endpoints: list[Endpoint] = ENDPOINTS) -> PluginContext:
    datastore = Datastore()
    datastore.set_endpoints(endpoints)
    return PluginContext(datastore, SaturationDetector(5, 0.8, 2.0))


def scorer(ctx: PluginContext, **params: object) -> Any:
    cls = REGISTRY["response-affinity-scorer"]
    return cls("response-affinity-scorer", cls.Params.model_validate(params), ctx)


def chained(endpoint: Endpoint | str) -> InferenceRequest:
    key = endpoint if isinstance(endpoint, str) else endpoint.key
    return parse(
        {"model": "m", "input": "next", "previous_response_id": make_response_id(route_tag(key))}
    )


def test_scores_the_holder_one_and_the_others_zero() -> None:
    ctx = context()
    plugin = scorer(ctx)
    cycle = CycleState()
    assert plugin.score(cycle, chained(ENDPOINTS[2]), ctx.datastore.all()) == [0, 0, 1, 0]
    assert cycle[HOLDER] == ENDPOINTS[2].key and plugin.found == 1


@pytest.mark.parametrize(
    "previous",
    [
        None,  # no previous response: a first turn
        "resp_123",  # not one of ours (an OpenAI id, a client's guess)
        "resp_" + "A" * 16 + "0" * 32,  # upper-case hex: not our format
        "chatcmpl-" + "0" * 48,
        make_response_id(route_tag("10.9.9.9:8000")),  # a tag of no known endpoint
    ],
)
def test_no_or_unknown_previous_response_is_neutral(previous: str | None) -> None:
    ctx = context()
    request = parse({"model": "m", "input": "x", "previous_response_id": previous})
    cycle = CycleState()
    assert scorer(ctx).score(cycle, request, ctx.datastore.all()) == [0.0] * 4
    assert HOLDER not in cycle


def test_the_tag_map_follows_discovery() -> None:
    ctx = context()
    plugin = scorer(ctx)
    late = Endpoint("10.0.0.9", 8000)
    ctx.datastore.set_endpoints([*ENDPOINTS[1:], late])  # 10.0.0.1 went, 10.0.0.9 came
    states = ctx.datastore.all()
    assert plugin.score(CycleState(), chained(ENDPOINTS[0]), states) == [0.0] * 4
    assert plugin.unknown == 1
    assert plugin.score(CycleState(), chained(late), states) == [0, 0, 0, 1]
    # A relabelled endpoint (removed and added under one key) keeps its tag.
    relabelled = Endpoint("10.0.0.9", 8000, labels=(("role", "decode"),))
    ctx.datastore.set_endpoints([*ENDPOINTS[1:], relabelled])
    assert plugin.score(CycleState(), chained(late), ctx.datastore.all()) == [0, 0, 0, 1]


def test_a_holder_filtered_out_is_neutral_for_the_rest() -> None:
    ctx = context()
    plugin = scorer(ctx)
    others = ctx.datastore.all()[1:]
    assert plugin.score(CycleState(), chained(ENDPOINTS[0]), others) == [0.0] * 3
    assert plugin.filtered == 1


def test_requests_naming_a_response_in_their_path_go_to_its_holder() -> None:
    ctx = context()
    rid = make_response_id(route_tag(ENDPOINTS[1].key))
    states = ctx.datastore.all()
    for path in (
        f"/v1/responses/{rid}",
        f"/v1/responses/{rid}/cancel",
        f"/v1/responses/{rid}/input_items?limit=5",
    ):
        request = InferenceRequest("r", {":method": "GET", ":path": path})
        assert scorer(ctx).score(CycleState(), request, states) == [0, 1, 0, 0]
        assert scorer(ctx, byPath=False).score(CycleState(), request, states) == [0.0] * 4
    with pytest.raises(ValueError, match="byPath"):
        scorer(ctx, byPath="sometimes")
    with pytest.raises(ValueError, match="extra"):
        scorer(ctx, weight=3)  # the weight belongs to the profile


# --- the default profile -------------------------------------------------------------------


async def test_default_profile_sends_a_follow_up_to_its_holder_however_loaded() -> None:
    """Only the holder's store has the conversation: another engine could only answer 404,
    so the holder is kept however loaded, where the scorer alone would go elsewhere."""
    ctx = context()
    for state in ctx.datastore.all():
        state.metrics.updated_at = time.monotonic()
    scheduler = Scheduler.from_config(parse_config(DEFAULT_CONFIG_YAML), ctx)
    states = ctx.datastore.all()
    holder = states[0]
    for in_flight in (2, 12):
        holder.in_flight_requests = in_flight
        result = await scheduler.schedule(chained(holder.endpoint), states, CycleState())
        assert result.primary is holder
    # A first turn is placed by load: the busy holder loses on predicted latency.
    first_turn = parse({"model": "m", "input": "hello"})
    assert (await scheduler.schedule(first_turn, states, CycleState())).primary is not holder
    # A holder that is gone (not a candidate) leaves the choice to the other plugins.
    result = await scheduler.schedule(chained(holder.endpoint), states[1:], CycleState())
    assert result.primary is not None and result.primary is not holder


def test_the_filter_keeps_only_a_candidate_holder() -> None:
    ctx = context()
    cls = REGISTRY["response-affinity-filter"]
    plugin: Any = cls("response-affinity-filter", cls.Params(), ctx)
    states = ctx.datastore.all()
    assert plugin.filter(CycleState(), chained(ENDPOINTS[3]), states) == [states[3]]
    assert plugin.filter(CycleState(), chained(ENDPOINTS[3]), states[:3]) == states[:3]
    first_turn = parse({"model": "m", "input": "hello"})
    assert plugin.filter(CycleState(), first_turn, states) == states
    assert (plugin.found, plugin.filtered) == (1, 1)


# --- through the EPP's ext-proc server -----------------------------------------------------

A = Endpoint("127.0.0.1", 18001)
B = Endpoint("127.0.0.1", 18002)


async def route(epp: Any, channel_for: Any, request_headers: dict[str, str], payload: bytes) -> Any:
    stream = Stream(channel_for(epp))
    await stream.send(headers(request_headers), body(payload))
    (response, *_) = await stream.recv(1)
    await stream.close()
    return response


async def test_every_routed_request_carries_its_endpoints_tag_and_chains_follow_it(
    epp_factory, channel_for
) -> None:
    epp = await epp_factory(static_endpoints=[A, B])
    tags = {route_tag(A.key): A.key, route_tag(B.key): B.key}
    first = await route(epp, channel_for, RESPONSES, b'{"model":"m","input":"hi"}')
    sent = set_headers(first)
    # The header names the primary first, then the fallbacks; the tag is the primary's.
    primary = sent["x-gateway-destination-endpoint"].split(",")[0]
    assert tags[sent[ROUTE_TAG_HEADER]] == primary
    for target in (A, B, B, A):
        rid = make_response_id(route_tag(target.key))
        payload = json.dumps({"model": "m", "input": "more", "previous_response_id": rid})
        sent = set_headers(await route(epp, channel_for, RESPONSES, payload.encode()))
        # Only the holder is left: no fallback that could only answer 404.
        assert sent["x-gateway-destination-endpoint"] == target.key
        assert sent[ROUTE_TAG_HEADER] == route_tag(target.key)
        await asyncio.sleep(0)
    assert epp.metrics.response_affinity.labels("holder")._value.get() == 4
    # A tag of no known endpoint (an engine gone, or a client's invention) routes as a
    # first turn would; the engine that gets it answers for the id itself.
    stranger = make_response_id(route_tag("10.1.2.3:8000"))
    payload = json.dumps({"model": "m", "input": "x", "previous_response_id": stranger})
    sent = set_headers(await route(epp, channel_for, RESPONSES, payload.encode()))
    assert sent["x-gateway-destination-endpoint"].split(",")[0] in (A.key, B.key)
    assert epp.metrics.response_affinity.labels("unknown")._value.get() == 1
    # Anthropic bodies route too (the engine may answer 404; that is not the EPP's call).
    anthropic = b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}'
    assert set_headers(await route(epp, channel_for, MESSAGES, anthropic))[ROUTE_TAG_HEADER] in tags


@pytest.mark.parametrize(
    "payload",
    [
        b'{"model":"m","input":[1]}',
        b'{"model":"m","input":"x","previous_response_id":{"id":"resp_1"}}',
        b'{"model":"m","input":[{"type":"function_call","name":3}]}',
    ],
)
async def test_malformed_responses_body_is_a_400_naming_the_field(
    payload: bytes, epp_factory, channel_for
) -> None:
    epp = await epp_factory(static_endpoints=[A])
    response = await route(epp, channel_for, RESPONSES, payload)
    assert response.immediate_response.status.code == 400
    error = json.loads(response.immediate_response.body)["error"]
    assert error["param"] in ("input[0]", "previous_response_id")
    assert sum(s.in_flight_requests for s in epp.datastore.all()) == 0


async def test_usage_of_a_streamed_response_is_read_from_response_completed(
    epp_factory, channel_for
) -> None:
    """The Responses stream's usage (``input_tokens``…) sits in ``response.completed``'s
    ``response``; ``response.created`` carries ``"usage": null`` and is skipped."""
    epp = await epp_factory(static_endpoints=[A])
    stream = Stream(channel_for(epp))
    await stream.send(headers(RESPONSES), body(b'{"model":"m","input":"hi","stream":true}'))
    await stream.recv(2)
    await stream.send(response_headers({":status": "200", "content-type": "text/event-stream"}))
    await stream.recv(1)
    created = {"type": "response.created", "response": {"id": "resp_1", "usage": None}}
    delta = {"type": "response.output_text.delta", "delta": "a"}
    usage = {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 5}
    done = {"type": "response.completed", "response": {"id": "resp_1", "usage": usage}}
    events = b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in (created, delta, done)
    )
    await stream.send(response_body(events, True))
    await stream.recv(1)
    await stream.close()
    for _ in range(100):
        if epp.metrics.tokens.labels("completion")._value.get() == 5:
            break
        await asyncio.sleep(0.02)
    assert epp.metrics.tokens.labels("prompt")._value.get() == 11
    assert epp.metrics.tokens.labels("completion")._value.get() == 5
