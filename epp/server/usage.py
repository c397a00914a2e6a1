"""Reading the token usage out of a response body as it streams past the EPP."""

from __future__ import annotations

import json
from typing import Any

USAGE_BUFFER_LIMIT = 4 << 20


class UsageReader:
    """Finds the ``usage`` object in a JSON response or in an SSE stream's events (the
    Responses API's sits in the ``response`` of its ``response.completed`` event)."""

    def __init__(self) -> None:
        self.sse = False
        self._buffer = bytearray()
        self.usage: dict[str, Any] | None = None
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buffer += chunk
        if self.sse:
            while True:
                cut = self._buffer.find(b"\n")
                if cut < 0:
                    break
                line = bytes(self._buffer[:cut]).strip()
                del self._buffer[: cut + 1]
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._take(line[5:].strip())
        if len(self._buffer) > USAGE_BUFFER_LIMIT:
            self._overflow = True
            self._buffer.clear()

    def finish(self) -> None:
        if self._overflow:
            return
        if self.sse:
            line = bytes(self._buffer).strip()
            if line.startswith(b"data:"):
                self._take(line[5:].strip())
        elif self._buffer:
            self._take(bytes(self._buffer))
        self._buffer.clear()

    def _take(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(doc, dict):
            return
        usage = doc.get("usage")
        if usage is None and isinstance(doc.get("response"), dict):
            usage = doc["response"].get("usage")  # a Responses stream's response.completed
        if isinstance(usage, dict):
            self.usage = usage
