"""Tool calling: parsers that find tool calls in generated text (``--tool-call-parser``),
and the JSON schemas that force them (``tool_choice`` ``required`` or a named function).

Parsers, by vLLM's names: ``hermes`` (Hermes/Qwen: ``<tool_call>{json}</tool_call>``) and
``llama3_json`` (Llama 3.x: a bare ``{"name", "parameters"}`` object, optionally after
``<|python_tag|>``, several separated by ``;``).
"""

from .base import ToolCall, ToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool call parser {name!r} (known: {known})") from None


__all__ = ["PARSERS", "ToolCall", "ToolParser", "get_parser"]
