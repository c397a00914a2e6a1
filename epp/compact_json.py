"""Compact JSON text (``separators=(",", ":")``, non-ASCII kept) from msgspec.

The EPP re-serializes parts of a request body: chat messages as the prefix scorer's key
text, conversation items as rendered lines, a whole body whose model is rewritten. For
strings msgspec writes the same bytes as ``json.dumps(value, separators=(",", ":"),
ensure_ascii=False)`` (every code point checked in tests/epp/test_compact_json.py), about
17 times faster: 69 µs against 1.16 ms for a 220 KB chat body. Only float exponents are
spelt differently (``1e16`` against ``1e+16``); the text is keyed on, never compared with
another implementation's.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_ENCODER = msgspec.json.Encoder()


def compact_json(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON.

    A body decoded by the EPP's own parser cannot hold a lone UTF-16 surrogate (msgspec's
    decoder refuses it) or an integer past 64 bits; values built elsewhere can, and for
    them the standard library writes the text and a lone surrogate becomes ``?``.
    """
    try:
        return _ENCODER.encode(value)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return text.encode("utf-8", "replace")
