"""The contract between the engine core (scheduler, KV manager) and whatever computes tokens.

The scheduler decides, each step, which slice of which sequences to compute; a model
runner (real model on CPU/CUDA, or the simulated timing model) computes them and samples.
Keeping this seam small is what lets the simulated mode share the real scheduler and KV
manager, and what lets FlashInfer slot in later behind the same runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs (validated by the API layer before they get here)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Top-N logprobs per generated token (None: off; 0: only the chosen token's).
    logprobs: int | None = None
    # Top-N logprobs per prompt token (None: off). Such requests skip prefix-cache reads:
    # a cached block has no logits to give.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI: subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF/CTRL: divides (>0) or multiplies (<0) the logit
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens
    include_stop_str_in_output: bool = False
    # vLLM's bad_words as token sequences: the last token of each is banned wherever the
    # output so far ends with the ones before it (a one-token word: always).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def needs_history(self) -> bool:
        """Penalties look at the tokens so far (the sampler needs the request's ids)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprob: the token that is there and the N most likely ones.

    Log-probabilities are of the distribution sampled from: the logits divided by the
    temperature (raw logits for greedy rows), before top-k/top-p masking.
    """

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: a prefill chunk, or one decode token."""

    request_id: str
    token_ids: list[int]  # tokens whose KV is computed this step
    start_pos: int  # position of token_ids[0] in the sequence (= tokens already in KV)
    block_table: list[int]  # KV block ids covering positions [0, start_pos + len(token_ids))
    sample: bool  # sample a next token after this chunk (last prefill chunk, or decode)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_generated: int = 0  # output tokens so far (seeded sampling uses it as the offset)
    # Prompt tokens after this chunk's last position, for prompt logprobs (else empty):
    # the chunk's last logits score the first of them.
    next_prompt_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    # For penalties (else empty): the prompt's and the output's token ids so far.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Token ids masked this step (EOS and stop ids while under min_tokens).
    blocked_token_ids: tuple[int, ...] = ()
    # Structured output: the request's GrammarState (its bitmask restricts sampling).
    grammar: Any = None
    # The LoRA adapter this sequence runs with (None: the base model).
    lora_name: str | None = None


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    # (source, destination) KV block ids to copy before the forward pass: the private
    # copy of a shared prompt block that an n > 1 sibling is about to write into.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class ModelRunner(Protocol):
    """Computes scheduled tokens over the paged KV cache and samples next tokens."""

    block_size: int
    num_blocks: int  # KV cache capacity in blocks, fixed after start-up

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """One entry per seq, in order: the sampled token id, or None where sample=False.

        ``batch.block_copies`` are done first (a runner without KV tensors skips them).
        """
        ...

    def release(self, request_id: str) -> None:
        """Forget per-request state (e.g. a seeded generator) once a request ends."""
        ...
