"""``tools`` and ``tool_choice`` → what the engine must do, as vLLM decides it.

- ``none``: tools only reach the chat template; the text is the answer.
- ``auto`` (the default when tools are given): the model decides, then the
  ``--tool-call-parser`` finds calls; needs ``--enable-auto-tool-choice`` (else 400).
  Where the parser's markup is fixed (hermes), a structural tag lets the model write
  free text, but once it opens the markup it can only name an offered function and
  write arguments valid for it (see :meth:`ToolPlan.auto_structural_tag`).
- ``required``: a JSON schema forces ``[{"name": one of the tools, "parameters": its
  schema}, ...]`` (one item when ``parallel_tool_calls`` is false).
- a named function: its parameters' schema forces the arguments object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, cast

from .base import ToolParser

Mode = Literal["none", "auto", "required", "named"]
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: tuple[dict[str, Any], ...]  # the "function" objects
    name: str | None = None  # the named function
    parallel: bool = True

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema that forces the calls (required / named), else None."""
        if self.mode == "named":
            fn = next(t for t in self.tools if t["name"] == self.name)
            return dict(fn.get("parameters") or _EMPTY_PARAMS)
        if self.mode != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["name"]]},
                    "parameters": t.get("parameters") or _EMPTY_PARAMS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def auto_structural_tag(self, parser: ToolParser) -> dict[str, Any] | None:
        """For ``auto``: xgrammar's structural tag that leaves text free until the parser's
        start marker, then forces a call of one offered function with its parameters'
        schema (one call unless ``parallel_tool_calls``). None when the mode is not auto
        or the parser's markup is not fixed. Small models otherwise invent tool names."""
        if self.mode != "auto":
            return None
        tags = []
        for fn in self.tools:
            around = parser.call_tag(fn["name"])
            if around is None:
                return None
            params = fn.get("parameters") or _EMPTY_PARAMS
            tags.append({"type": "tag", "begin": around[0], "end": around[1],
                         "content": {"type": "json_schema", "json_schema": params}})  # fmt: skip
        return {"type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": list(parser.start_markers),
                           "tags": tags,
                           "stop_after_first": not self.parallel}}  # fmt: skip

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` for the chat template, in OpenAI's shape."""
        return [{"type": "function", "function": t} for t in self.tools] or None


def _functions(tools: list[Any]) -> tuple[dict[str, Any], ...]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolChoiceError("tools", f"tools[{i}] must be {{'type': 'function', ...}}.")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError("tools", f"tools[{i}].function.name is required.")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolChoiceError("tools", f"tools[{i}].function.parameters must be an object.")
        out.append(fn)
    return tuple(out)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
               auto_enabled: bool) -> ToolPlan:  # fmt: skip
    fns = _functions(tools or [])
    choice = tool_choice if tool_choice is not None else ("auto" if fns else "none")
    parallel_ok = parallel is not False
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolChoiceError(
                "tool_choice",
                "tool_choice must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}.',
            )
        if not any(f["name"] == name for f in fns):
            raise ToolChoiceError("tool_choice", f"tool_choice names {name!r}, not in tools.")
        return ToolPlan("named", fns, name, parallel_ok)
    if choice not in ("none", "auto", "required"):
        raise ToolChoiceError("tool_choice", f"tool_choice {json.dumps(choice)} is not valid.")
    mode = cast(Mode, choice)
    if mode != "none" and not fns:
        raise ToolChoiceError("tool_choice", f"tool_choice {choice!r} needs tools.")
    if mode == "auto" and not auto_enabled:
        raise ToolChoiceError(
            "tool_choice",
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
        )
    return ToolPlan(mode, fns, None, parallel_ok)
