"""Which grammar a request asks for, from any of the fields clients use for it.

OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``. vLLM: ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` (EBNF), and the newer ``structured_outputs``
(``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``). At most one may
be given; each problem is a :class:`GrammarSpecError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
_STRUCTURED_KEYS: dict[str, Kind] = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


class GrammarSpecError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar request, hashable: the compile cache's key.

    ``value`` is canonical text: a JSON schema dumped with sorted keys, a regex, EBNF,
    or the choices as a JSON list. ``param`` is the field it came from (for errors).
    """

    kind: Kind
    value: str
    param: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)


def _schema_text(param: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise GrammarSpecError(param, f"{param} is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise GrammarSpecError(param, f"{param} must be a JSON schema object.")
    return json.dumps(schema, sort_keys=True)


def _choices_text(param: str, choices: Any) -> str:
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise GrammarSpecError(param, f"{param} must be a non-empty list of non-empty strings.")
    return json.dumps(choices)


def _text(param: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarSpecError(param, f"{param} must be a non-empty string.")
    return value


def _make(kind: Kind, param: str, value: Any) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec(kind, _schema_text(param, value), param)
    if kind == "choice":
        return GrammarSpec(kind, _choices_text(param, value), param)
    if kind == "json_object":
        return GrammarSpec(kind, "", param)
    return GrammarSpec(kind, _text(param, value), param)


def _from_response_format(fmt: dict[str, Any]) -> GrammarSpec | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise GrammarSpecError(
                "response_format", "response_format.json_schema.schema is required."
            )
        return GrammarSpec(
            "json", _schema_text("response_format", inner["schema"]), "response_format"
        )
    raise GrammarSpecError(
        "response_format",
        f"response_format type {kind!r} is not supported (text, json_object, json_schema).",
    )


def _from_structured_outputs(value: dict[str, Any]) -> GrammarSpec | None:
    given = [k for k, v in value.items() if k in _STRUCTURED_KEYS and v not in (None, False)]
    unknown = sorted(
        k for k, v in value.items() if k not in _STRUCTURED_KEYS and v not in (None, False)
    )
    if unknown:
        raise GrammarSpecError(
            "structured_outputs", f"structured_outputs.{unknown[0]} is not supported."
        )
    if len(given) > 1:
        raise GrammarSpecError(
            "structured_outputs",
            f"structured_outputs takes one constraint, got {', '.join(sorted(given))}.",
        )
    if not given:
        return None
    key = given[0]
    return _make(_STRUCTURED_KEYS[key], f"structured_outputs.{key}", value[key])


def spec_from_request(req: Any) -> GrammarSpec | None:
    """The one grammar `req` asks for (None: unconstrained)."""
    found: list[GrammarSpec] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        spec = _from_response_format(fmt)
        if spec is not None:
            found.append(spec)
    guided: list[tuple[str, Kind]] = [
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ]
    for name, kind in guided:
        value = getattr(req, name, None)
        if value is not None:
            found.append(_make(kind, name, value))
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        spec = _from_structured_outputs(structured)
        if spec is not None:
            found.append(spec)
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise GrammarSpecError(found[1].param, f"Only one output constraint is allowed: {names}.")
    return found[0] if found else None
