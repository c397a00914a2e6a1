"""What a tool-call parser does: split model text into content and tool calls."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One call in OpenAI's shape; ``arguments`` is a JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip

    def delta(self, index: int) -> dict[str, Any]:
        """The streamed form: one delta carrying the whole call."""
        return {"index": index, **self.openai()}


def call_from_json(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """``{"name": str, args_key: object}`` → ToolCall (None if it is not that shape)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


class ToolParser:
    """Finds tool calls in a whole output; for streaming, says where they may start."""

    # Text at which tool-call markup begins: streamed content stops there.
    start_markers: tuple[str, ...] = ()

    def call_tag(self, name: str) -> tuple[str, str] | None:
        """The exact text around one call of function `name`: (up to its arguments object,
        after it). None: this format has no fixed markup, so ``auto`` stays unconstrained."""
        return None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content left over, tool calls); no calls → the text as content."""
        raise NotImplementedError

    def tool_start(self, text: str) -> int | None:
        """Where tool-call markup starts in `text` (None: not seen yet)."""
        found = [i for m in self.start_markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    def holdback(self, text: str) -> int:
        """How many trailing characters of `text` could begin a marker (keep them back)."""
        keep = 0
        for marker in self.start_markers:
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    keep = max(keep, n)
                    break
        return keep
