"""Structured output (xgrammar) through the real `openai` client on the real tiny model.

The tiny model's weights are random: unconstrained, it writes byte soup (checked below),
so every parse-and-validate here holds only because the grammar's bitmask made it so.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from .conftest import MODEL, Server

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        # A pattern, not maxLength: xgrammar 0.2.8's maxLength rule admits raw control
        # characters, which strict JSON parsers refuse (see docs/engine.md).
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a person as JSON."}]


def _valid(text: str) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_unconstrained_output_is_not_json(real_server: Server) -> None:
    """The premise: without a grammar the tiny model does not produce this schema."""
    res = real_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, seed=0, temperature=1.0
    )
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        _valid(res.choices[0].message.content or "")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_format_json_schema_validates(real_server: Server, seed: int) -> None:
    res = real_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, seed=seed, temperature=1.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    choice = res.choices[0]
    assert choice.finish_reason == "stop"
    _valid(choice.message.content or "")


def test_json_schema_n_choices_and_stream(real_server: Server) -> None:
    client = real_server.client()
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    res = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, n=3, seed=5, response_format=fmt
    )
    assert sorted(c.index for c in res.choices) == [0, 1, 2]
    for choice in res.choices:
        _valid(choice.message.content or "")
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=300, n=2, seed=7, response_format=fmt,
        stream=True,
    )  # fmt: skip
    parts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in parts.values():
        _valid(text)


def test_completions_guided_fields(real_server: Server) -> None:
    client = real_server.client()

    def text(**extra: Any) -> str:
        res = client.completions.create(
            model=MODEL, prompt="The answer is", max_tokens=200, extra_body=extra
        )
        assert res.choices[0].finish_reason == "stop", res
        return res.choices[0].text

    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text(guided_regex=r"[a-c]{3}-[0-9]{2}"))
    assert text(guided_choice=["yes", "no", 'say "maybe"']) in {"yes", "no", 'say "maybe"'}
    assert re.fullmatch(r"a[bc]*d", text(guided_grammar='root ::= "a" ("b" | "c")* "d"'))
    _valid(text(guided_json=SCHEMA))
    _valid(text(guided_json=json.dumps(SCHEMA)))
    _valid(text(structured_outputs={"json": SCHEMA}))
    assert text(structured_outputs={"choice": ["left", "right"]}) in {"left", "right"}
    assert re.fullmatch(r"[0-9]{4}", text(structured_outputs={"regex": "[0-9]{4}"}))


def test_json_object_on_chat(real_server: Server) -> None:
    res = real_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=400, seed=3,
        response_format={"type": "json_object"},
    )  # fmt: skip
    content = res.choices[0].message.content or ""
    assert content[:1] == "{"  # JSON mode promises an object, never an array
    if res.choices[0].finish_reason == "stop":  # free JSON may run past max_tokens
        assert isinstance(json.loads(content), dict)
    else:
        assert res.choices[0].finish_reason == "length"


def test_completions_stream_with_grammar(real_server: Server) -> None:
    stream = real_server.client().completions.create(
        model=MODEL, prompt="x", max_tokens=300, stream=True, extra_body={"guided_json": SCHEMA}
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    _valid(text)


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ({"guided_json": {"type": 5}}, "guided_json", "Type should be a string"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": 'root ::= foo'}, "guided_grammar", "foo"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema is required"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs", "bogus"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "Only one"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_grammars_are_400_naming_the_field(
    real_server: Server, extra: dict[str, Any], param: str, words: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        real_server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=stream, extra_body=extra
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and words in error["message"], error


def test_simulated_mode_refuses_grammars(sim_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sim_server.client().completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "[0-9]+"}
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "guided_regex"
    assert "simulated" in info.value.body["message"]
