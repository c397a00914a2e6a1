"""Responses conversations through the real Envoy and EPP (default profile) to real
simulated engines: every turn chained with ``previous_response_id`` reaches the engine
that holds the conversation, as the openai SDK sends them.

Each engine keeps its own response store, so a turn sent anywhere else would be a 404:
the chain succeeding over several turns, on two engines, is the affinity at work. The
engine that served each turn is Envoy's ``%UPSTREAM_HOST%`` (``x-infergate-upstream-host``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from infergate.envoy.bootstrap import UPSTREAM_HOST_HEADER
from infergate.stack.local import LocalStack, StackSpec
from infergate.wire.responses import route_tag, route_tag_of


@pytest.fixture(scope="module")
def default_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[LocalStack]:
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        workdir=tmp_path_factory.mktemp("responses-stack"),
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _turn(client: openai.OpenAI, text: str, previous: str | None) -> tuple[str, str]:
    """One turn; its response id and the engine that served it."""
    raw = client.responses.with_raw_response.create(
        model="tiny",
        instructions="You answer briefly.",
        input=text,
        max_output_tokens=4,
        previous_response_id=previous,
    )
    return raw.parse().id, raw.headers[UPSTREAM_HOST_HEADER]


def test_three_turn_chains_stay_on_their_holder(default_stack: LocalStack) -> None:
    client = _client(default_stack)
    served_by: set[str] = set()
    for conversation in range(6):
        rid, engine = _turn(client, f"conversation {conversation} starts", None)
        assert route_tag_of(rid) == route_tag(engine)  # the EPP's tag, from the engine
        for turn in range(2):
            rid, next_engine = _turn(client, f"turn {turn}", rid)
            assert next_engine == engine and route_tag_of(rid) == route_tag(engine)
        served_by.add(engine)
        # Retrieving the response goes to its holder too (any other engine has none).
        got = client.responses.retrieve(rid)
        assert got.id == rid and got.previous_response_id is not None
    assert served_by  # at least one engine served; both usually do


def test_a_streamed_follow_up_reaches_the_holder(default_stack: LocalStack) -> None:
    client = _client(default_stack)
    first, engine = _turn(client, "stream next", None)
    events = list(
        client.responses.create(
            model="tiny", input="go on", max_output_tokens=4, previous_response_id=first,
            stream=True,
        )
    )  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    # It stops at max_output_tokens: OpenAI's (and the engine's) last event is then
    # response.incomplete, carrying the finished response.
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert route_tag_of(last.response.id) == route_tag(engine)


def test_unknown_previous_response_is_the_engines_404(default_stack: LocalStack) -> None:
    """An id this fleet never made (an OpenAI id, a guessed one) routes like a first turn;
    the engine answers 404 naming the field, never a 500."""
    for bogus in ("resp_123", "resp_" + "0" * 48):
        answer = httpx.post(
            f"{default_stack.base_url}/v1/responses",
            json={"model": "tiny", "input": "x", "previous_response_id": bogus},
            timeout=30,
        )
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["param"] == "previous_response_id"
    bad = httpx.post(
        f"{default_stack.base_url}/v1/responses",
        json={"model": "tiny", "input": [{"role": 5, "content": "x"}]},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0]"
