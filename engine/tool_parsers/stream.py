"""One chat choice's text → content and tool calls, streamed or whole.

Per mode (see :mod:`.choice`): ``named`` streams the forced text as the one call's
``arguments``; ``required`` parses the forced JSON array at the end; ``auto`` streams
content until the parser's markup may begin (holding back a partial marker) and parses
what follows at the end; ``none`` passes text through.

``required`` with parallel calls allowed: the grammar does not bound the array (as in
vLLM), and a small model may keep adding calls until ``max_tokens`` without closing it.
Then the answer stops at the first complete call: that call is returned, the calls after
it and the cut one are dropped (``finish_reason`` stays ``length``). A model that does not
close its array is usually repeating itself, and one call is what the request asked for
at least. No complete call at all (cut inside the first) leaves the text as content.
"""

from __future__ import annotations

import json
from typing import Any

from .base import ToolCall, ToolParser, call_from_json
from .choice import ToolPlan

Delta = dict[str, Any]


class ToolCallState:
    def __init__(self, plan: ToolPlan, parser: ToolParser | None) -> None:
        self.plan, self.parser = plan, parser
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.in_tools = False
        self.named_call: ToolCall | None = None

    @property
    def active(self) -> bool:
        return self.plan.mode != "none"

    # -- whole ---------------------------------------------------------------------
    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        mode = self.plan.mode
        if mode == "named":
            assert self.plan.name is not None
            return None, [ToolCall(self.plan.name, _strict_json(text))]
        if mode == "required":
            try:
                # strict=False: xgrammar's JSON string rule admits raw control characters,
                # which strict JSON refuses; the arguments are re-serialized, escaped.
                items = json.loads(text, strict=False)
            except json.JSONDecodeError:
                items = _first_complete_item(text)  # the array was not closed
            calls = (
                [call_from_json(i, "parameters") for i in items] if isinstance(items, list) else []
            )
            good = [c for c in calls if c is not None]
            return (None, good) if good else (text, [])
        if mode == "auto" and self.parser is not None:
            return self.parser.extract(text)
        return text, []

    # -- streamed ----------------------------------------------------------------------
    def feed(self, piece: str, finished: bool) -> tuple[str | None, list[Delta]]:
        """(content delta, tool_call deltas) for a new piece of text."""
        self.text += piece
        mode = self.plan.mode
        if mode == "named":
            return None, self._named(piece)
        if mode == "required":
            return (None, []) if not finished else self._final()
        if mode != "auto" or self.parser is None:
            return (piece or None), []
        if not self.in_tools:
            start = self.parser.tool_start(self.text)
            if start is not None:
                self.in_tools = True
                end = start
            else:
                end = len(self.text) - (0 if finished else self.parser.holdback(self.text))
            content = self.text[self.sent : max(end, self.sent)]
            self.sent = max(end, self.sent)
        else:
            content = ""
        deltas: list[Delta] = []
        if finished:
            rest, deltas = self._final()
            content += rest or ""
        return (content or None), deltas

    def _named(self, piece: str) -> list[Delta]:
        if self.named_call is None:
            assert self.plan.name is not None
            self.named_call = ToolCall(self.plan.name, "")
            return [{"index": 0, "id": self.named_call.id, "type": "function",
                     "function": {"name": self.plan.name, "arguments": piece}}]  # fmt: skip
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def _final(self) -> tuple[str | None, list[Delta]]:
        """At the end: the calls in what was held back, or that text as content."""
        held = self.text[self.sent :]
        self.sent = len(self.text)
        if self.plan.mode == "required":
            content, calls = self.split(self.text)
        elif self.parser is not None:
            content, calls = self.parser.extract(held)
        else:
            content, calls = held, []
        return content, [c.delta(i) for i, c in enumerate(calls)]

    def called(self, calls: list[Any]) -> bool:
        return bool(calls) and self.plan.mode in ("auto", "required")


def _first_complete_item(text: str) -> list[Any] | None:
    """``[first]`` when ``text`` is an unclosed JSON array whose first item is complete."""
    start = text.lstrip()
    if not start.startswith("["):
        return None
    rest = start[1:]
    try:
        item, _ = json.JSONDecoder(strict=False).raw_decode(rest, len(rest) - len(rest.lstrip()))
    except json.JSONDecodeError:
        return None
    return [item]


def _strict_json(text: str) -> str:
    """`text` with raw control characters escaped when it holds any (xgrammar's string
    rule admits them, clients' ``json.loads`` refuses them); otherwise unchanged, so the
    whole answer's arguments equal the streamed ones."""
    if not any(ord(c) < 0x20 for c in text):
        return text
    try:
        return json.dumps(json.loads(text, strict=False), ensure_ascii=False)
    except json.JSONDecodeError:  # cut by max_tokens: leave it as generated
        return text
