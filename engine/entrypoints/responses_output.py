"""Output items of one response and the stream events that build them, in OpenAI's order.

:class:`OutputBuilder` takes what the chat path's tool-call state makes of each engine
output (a content delta, chat-shaped tool-call deltas) and returns the Responses events
for it: a ``message`` item with one ``output_text`` part for content, a ``function_call``
item per call. A whole (non-streamed) answer runs through the same builder and keeps only
the items, so both forms agree by construction.
"""

from __future__ import annotations

import uuid
from typing import Any

Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self._message: int | None = None  # output index of the open message item
        self._calls: dict[int, int] = {}  # chat tool-call index → output index (open calls)

    def event(self, kind: str, **fields: Any) -> Event:
        """One stream event; ``sequence_number`` orders every event of the response."""
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    # -- deltas ------------------------------------------------------------------------
    def feed(self, content: str | None, calls: list[dict[str, Any]]) -> list[Event]:
        events = self._text(content) if content else []
        for delta in calls:
            events += self._call(delta)
        return events

    def _text(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if self._message is None:
            events += self._close_calls("completed")
            events += self._open_message()
        index = self._message
        assert index is not None
        item = self.items[index]
        item["content"][0]["text"] += delta
        events.append(self.event("response.output_text.delta", item_id=item["id"],
                                 output_index=index, content_index=0, delta=delta,
                                 logprobs=[]))  # fmt: skip
        return events

    def _open_message(self) -> list[Event]:
        item: dict[str, Any] = {"id": _item_id("msg"), "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        self._message = len(self.items)
        self.items.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self.event("response.output_item.added", output_index=self._message,
                           item={**item, "content": []})  # fmt: skip
        item["content"].append(part)
        return [added, self.event("response.content_part.added", item_id=item["id"],
                                  output_index=self._message, content_index=0,
                                  part=dict(part))]  # fmt: skip

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        """A chat tool-call delta: one carrying ``id`` opens a call, the rest add text."""
        fn = delta.get("function") or {}
        events: list[Event] = []
        if "id" in delta:
            events += self._close_message("completed")
            item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": _item_id("call"), "name": fn.get("name", ""), "arguments": ""}  # fmt: skip
            self._calls[delta.get("index", 0)] = len(self.items)
            self.items.append(item)
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.items) - 1, item=dict(item)))  # fmt: skip
        index = self._calls.get(delta.get("index", 0))
        piece = fn.get("arguments") or ""
        if index is None or not piece:
            return events
        item = self.items[index]
        item["arguments"] += piece
        events.append(self.event("response.function_call_arguments.delta",
                                 item_id=item["id"], output_index=index, delta=piece))  # fmt: skip
        return events

    # -- the end -----------------------------------------------------------------------
    def finish(self, status: str) -> list[Event]:
        """Close every open item (``status``: completed, or incomplete when cut short).
        An answer with no item at all (the model ended at once) is an empty message, so a
        response always has output, as OpenAI's."""
        opened = [] if self.items else self._open_message()
        return opened + self._close_message(status) + self._close_calls(status)

    def _close_message(self, status: str) -> list[Event]:
        index, self._message = self._message, None
        if index is None:
            return []
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **ids, part=dict(part)),
            self.event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def _close_calls(self, status: str) -> list[Event]:
        events: list[Event] = []
        for index in self._calls.values():
            item = self.items[index]
            item["status"] = status
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"],
                                     arguments=item["arguments"]))  # fmt: skip
            events.append(self.event("response.output_item.done", output_index=index,
                                     item=dict(item)))  # fmt: skip
        self._calls.clear()
        return events
