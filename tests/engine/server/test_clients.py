"""Real clients nobody here wrote, against the real tiny model: LangChain's
``bind_tools`` and ``with_structured_output``, and the openai SDK's ``parse`` helper.

The tiny model's text is byte soup; what these clients get back parses only because the
engine's grammars (structured output, forced tool calls) made it so.
"""

from __future__ import annotations

from typing import Literal

import jsonschema
import openai
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from .conftest import API_KEY, MODEL, Server


class Person(BaseModel):
    """A person."""

    name: Literal["Ada", "Alan", "Grace"]
    age: int = Field(ge=0, le=120)
    admin: bool


PERSON_SCHEMA = {
    "title": "person",
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "count"],
    "additionalProperties": False,
}


@tool
def get_weather(city: Literal["Paris", "Oslo"], days: int) -> str:
    """Weather forecast for a city."""
    return f"{city}: sunny for {days} days"


def _chat(server: Server) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY,  # type: ignore[arg-type]
                      max_retries=0, max_completion_tokens=200, temperature=1.0, seed=0)  # fmt: skip


def test_langchain_bind_tools_invoke_returns_a_tool_call(real_server: Server) -> None:
    for choice in ("required", "get_weather"):
        llm = _chat(real_server).bind_tools([get_weather], tool_choice=choice,
                                            parallel_tool_calls=False)  # fmt: skip
        message = llm.invoke("What's the weather in Oslo for 3 days?")
        (call,) = message.tool_calls
        assert call["name"] == "get_weather"
        assert call["args"]["city"] in ("Paris", "Oslo")
        assert isinstance(call["args"]["days"], int)
        assert get_weather.invoke(call["args"])  # the args fit the tool's own signature


def test_langchain_with_structured_output_json_schema(real_server: Server) -> None:
    dict_out = _chat(real_server).with_structured_output(PERSON_SCHEMA, method="json_schema")
    value = dict_out.invoke("Where and how many?")
    jsonschema.validate(value, PERSON_SCHEMA)
    model_out = _chat(real_server).with_structured_output(Person, method="json_schema")
    person = model_out.invoke("Describe a person.")
    assert isinstance(person, Person)


def test_langchain_with_structured_output_json_mode_gets_an_object(real_server: Server) -> None:
    """LangChain's json_mode sends ``response_format: {"type": "json_object"}`` and parses
    the reply as JSON; the grammar makes it an object. Free JSON from the tiny model may
    still be cut by the token limit, which the openai SDK raises (with the reply)."""
    llm = _chat(real_server).with_structured_output(None, method="json_mode", include_raw=True)
    for prompt in ("Answer in JSON.", "A JSON object, please.", "JSON:"):
        try:
            out = llm.invoke(prompt)
        except openai.LengthFinishReasonError as cut:
            content = cut.completion.choices[0].message.content or ""
            assert content.startswith("{"), content[:40]
            continue
        assert out["raw"].content.startswith("{")
        assert out["parsing_error"] is None and isinstance(out["parsed"], dict)


def test_openai_sdk_parse_helper(real_server: Server) -> None:
    res = real_server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person, max_tokens=200, seed=1,
    )  # fmt: skip
    parsed = res.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert Person.model_validate_json(res.choices[0].message.content or "") == parsed
