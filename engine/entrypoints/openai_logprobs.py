"""Logprobs in OpenAI's and vLLM's response shapes (completions, chat, prompt_logprobs).

Token strings are each token decoded on its own (special tokens kept), as vLLM returns
them; ``text_offset`` counts characters of those strings from the start of the choice's
text (the echoed prompt included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from infergate.engine.interfaces import TokenLogprob

TokenText = Callable[[int], str]


def _top_dict(entry: TokenLogprob, text: TokenText) -> dict[str, float]:
    """The top-N as {token: logprob}, plus the chosen token (as vLLM includes it)."""
    out = {text(token): logprob for token, logprob in entry.top}
    out.setdefault(text(entry.token_id), entry.logprob)
    return out


class CompletionLogprobs:
    """Accumulates one completion choice's ``logprobs`` object, chunk by chunk."""

    def __init__(self, text: TokenText, start_offset: int = 0) -> None:
        self.text = text
        self.offset = start_offset

    def block(self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int],
              with_top: bool) -> dict[str, Any]:  # fmt: skip
        """The logprobs object for `token_ids` (an entry None: no context, e.g. token 0)."""
        tokens = [self.text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob if e else None for e in entries],
            "top_logprobs": [
                _top_dict(e, self.text) if e and with_top else (None if e is None else {})
                for e in entries
            ],
            "text_offset": offsets,
        }


def merge_completion_blocks(blocks: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    if not blocks:
        return None
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for b in blocks for v in b[k]] for k in keys}


def chat_content(entries: Sequence[TokenLogprob], text: TokenText) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` items for generated tokens."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
        for e in entries
    ]


def prompt_logprobs(
    entries: Sequence[TokenLogprob], text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for token 0, then {token id: {logprob, rank,
    decoded_token}} with the prompt token and the top-N."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for e in entries:
        ranks = {t: i + 1 for i, (t, _) in enumerate(e.top)}
        items = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank,
                                   "decoded_token": text(e.token_id)}}  # fmt: skip
        for token, logprob in e.top:
            items.setdefault(
                str(token),
                {"logprob": logprob, "rank": ranks[token], "decoded_token": text(token)},
            )
        out.append(items)
    return out
