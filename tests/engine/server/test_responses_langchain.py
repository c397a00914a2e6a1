"""An agent framework on ``/v1/responses``: LangChain's ``ChatOpenAI(use_responses_api=True)``
on the real tiny model — a plain turn, a stream, a forced tool call answered with a
``ToolMessage`` and chained by ``previous_response_id``, and structured output."""

from __future__ import annotations

from typing import Literal

import httpx
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field, SecretStr

from .conftest import API_KEY, MODEL, Server


class get_weather(BaseModel):
    """Forecast for a city."""

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


def _llm(server: Server, max_tokens: int, chained: bool = False) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=SecretStr(API_KEY),
                      use_responses_api=True, max_completion_tokens=max_tokens, max_retries=0,
                      use_previous_response_id=chained, temperature=0)  # fmt: skip


def _stored(server: Server, response_id: str) -> dict[str, object]:
    res = httpx.get(f"{server.url}/v1/responses/{response_id}",
                    headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)  # fmt: skip
    res.raise_for_status()
    body: dict[str, object] = res.json()
    return body


def test_invoke_and_stream(responses_server: Server) -> None:
    llm = _llm(responses_server, 6)
    message = llm.invoke("Hello")
    assert isinstance(message, AIMessage) and message.id is not None
    assert message.id.startswith("resp_") and message.text
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] <= 6
    chunks = list(llm.stream("Hi"))
    text = "".join(c.text for c in chunks)
    assert text and chunks[-1].usage_metadata is not None


@pytest.mark.parametrize("chained", [True, False])
def test_tool_loop(responses_server: Server, chained: bool) -> None:
    """Chained: LangChain sends only the tool output with ``previous_response_id``;
    not chained: the whole history as items (the call's ``function_call`` included).
    Both prompts are the same conversation."""
    llm = _llm(responses_server, 200, chained=chained)
    messages: list[BaseMessage] = [HumanMessage("Weather in Oslo?")]
    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert isinstance(called, AIMessage) and len(called.tool_calls) == 1
    call = called.tool_calls[0]
    assert call["name"] == "get_weather"
    get_weather.model_validate(call["args"])
    messages += [called, ToolMessage("sunny", tool_call_id=call["id"])]
    answer = _llm(responses_server, 4, chained=chained).invoke(messages)
    assert answer.id is not None and called.id is not None
    stored = _stored(responses_server, answer.id)
    assert stored["previous_response_id"] == (called.id if chained else None)
    usage = stored["usage"]
    assert isinstance(usage, dict)
    prompt = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": ""},
              {"role": "tool", "content": "sunny"}]  # fmt: skip
    assert usage["input_tokens"] == _prompt_len(responses_server, prompt)


def _prompt_len(server: Server, messages: list[dict[str, str]]) -> int:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    res = httpx.post(f"{server.url}/tokenize", json=body,
                     headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)  # fmt: skip
    return int(res.json()["count"])


def test_structured_output(responses_server: Server) -> None:
    llm = _llm(responses_server, 200)
    forecast = llm.with_structured_output(get_weather, method="json_schema").invoke("Weather?")
    assert isinstance(forecast, get_weather)
