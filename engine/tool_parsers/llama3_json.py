"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` as the whole output,
optionally after ``<|python_tag|>``; several calls separated by ``;``."""

from __future__ import annotations

import json

from .base import ToolCall, ToolParser, call_from_json

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start_markers = (_TAG, "{")

    def tool_start(self, text: str) -> int | None:
        """Only at the start of the output (after whitespace), as Llama 3 emits them."""
        stripped = text.lstrip()
        if stripped.startswith(_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if _TAG.startswith(stripped) else 0

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = self.tool_start(text)
        if start is None:
            return text, []
        body = text[start:].removeprefix(_TAG).strip()
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = call_from_json(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls
