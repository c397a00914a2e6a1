"""A request's life in the engine: waiting → running ⇄ preempted → finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from infergate.engine.interfaces import SamplingParams, TokenLogprob
from infergate.engine.lora.manager import LoRARequest

from infergate.wire.block_hash import block_hashes

if TYPE_CHECKING:
    from infergate.engine.structured_output.matcher import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; back in the waiting queue, to be recomputed
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` (``stop``, ``length``, ``abort``), None while live."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """Token-level state of one generation; the scheduler and KV manager read and move it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    lora: LoRARequest | None = None  # the adapter to run with (None: the base model)
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    skip_special_tokens: bool = True  # in the output text
    arrival_time: float = field(default_factory=time.monotonic)
    # vLLM's request priority: with --scheduling-policy priority a lower value is
    # admitted first and preempted last (ties by arrival); fcfs ignores it.
    priority: int = 0
    # Seconds added to arrival_time where --scheduling-policy priority orders the waiting
    # queue within a priority (the EPP's x-infergate-order-delay); fcfs ignores it.
    order_delay: float = 0.0
    # n > 1: the request whose prompt KV this one shares (a forked block table, see
    # KVCacheManager.fork); None for a request that prefills its own prompt.
    fork_parent: Request | None = None
    # Structured output: the request's grammar matcher (None: unconstrained).
    grammar: GrammarState | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    #: Prompt tokens not in the prefix cache when it arrived: its prefill while it waits
    #: (the scheduler's ``waiting_prefill_tokens``, for load reports).
    arrival_uncached_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)  # of every full block of all_token_ids
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    scheduled_time: float | None = None  # first admission (end of queueing)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    # Logprobs of prompt tokens 1.. (token 0 has no context), when asked for.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # P/D (engine/kv_transfer): the request's kv_transfer_params (do_remote_decode: hold
    # the KV for a decode engine), a pulled KV payload to commit before admission, and
    # how many prompt tokens that payload provided (not counted as local cache hits).
    kv_transfer_params: dict[str, Any] | None = None
    kv_payload: Any = None
    num_external_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def update_block_hashes(self, block_size: int) -> None:
        """Extend the hash chain over blocks that became full (prompt, then generated)."""
        done = len(self.block_hashes)
        if (done + 1) * block_size > self.num_tokens:
            return
        parent = self.block_hashes[-1] if done else None
        self.block_hashes.extend(
            block_hashes(
                self.all_token_ids,
                block_size,
                cache_salt=self.cache_salt,
                lora_name=self.lora.cache_key if self.lora is not None else None,
                parent=parent,
                start_block=done,
            )
        )

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Apply the token-level stop rules after a new token; True when finished."""
        token = self.output_token_ids[-1]
        if self.grammar is not None:
            self.grammar.accept(token)
        params = self.sampling
        if not params.ignore_eos and token in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif token in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token
        elif self.grammar is not None and self.grammar.finished:
            self.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        elif self.num_output_tokens >= params.max_tokens or (
            self.max_model_len is not None and self.num_tokens >= self.max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH
        return self.status.finished
