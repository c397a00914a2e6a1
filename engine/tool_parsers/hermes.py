"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

import json
import re

from .base import ToolCall, ToolParser, call_from_json

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    start_markers = ("<tool_call>",)

    def call_tag(self, name: str) -> tuple[str, str]:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = self.tool_start(text)
        if start is None:
            return text, []
        calls = []
        for body in _CALL.findall(text[start:]):
            try:
                call = call_from_json(json.loads(body, strict=False))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # malformed markup: hand the text back untouched
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls
