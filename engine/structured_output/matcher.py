"""Per-request grammar state and the batch's token bitmask.

Each engine request with a grammar owns a :class:`GrammarState` (an xgrammar matcher,
advanced by every accepted token). At sampling time the rows with a grammar fill their
rows of one packed bitmask ([rows, ceil(V/32)] int32, bit v of row r = token v allowed)
and :func:`apply_grammar_bitmask` applies it to the batch's logits in one op:
``logits[r, v] = -inf`` where the bit is 0.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr  # loaded by the compile that made `compiled`

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.rejected = False  # a token the grammar did not allow was forced in

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            log.warning("grammar rejected token %d; ending the request", token_id)
            self.rejected = True

    @property
    def finished(self) -> bool:
        """The grammar is complete (its stop token accepted) or cannot go on."""
        return self.rejected or self.matcher.is_terminated()


def apply_grammar_bitmask(
    logits: torch.Tensor, grammars: Sequence[GrammarState | None]
) -> torch.Tensor:
    """`logits` [B, V] with disallowed tokens at -inf in rows that have a grammar.

    Returns `logits` itself when no row has one, else a masked copy (the caller keeps the
    unmasked logits for logprobs).
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    import xgrammar as xgr  # a row has a grammar: a compile loaded it

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        state = grammars[i]
        assert state is not None
        state.fill(bitmask, i)
    masked = logits.clone()
    if masked.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab, indices=rows)
    else:
        xgr.apply_token_bitmask_inplace(
            masked, bitmask.to(masked.device, non_blocking=True), vocab_size=vocab, indices=rows
        )
    return masked
