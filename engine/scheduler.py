"""Continuous batching with a per-step token budget (vLLM V1's scheduling, simplified).

Every step, running requests go first — a decode costs one token, a partly prefilled
prompt continues with its next chunk — then waiting requests are admitted FCFS while the
token budget, ``max_num_seqs`` and free KV blocks allow; a prompt longer than what is left
of the budget is prefilled in chunks over several steps. There is no separate prefill
phase: "tokens to compute" is simply ``num_tokens - num_computed_tokens``. When a
running request cannot get a block, the most recently admitted request is preempted: its
blocks are freed (their cached hashes survive, so its recompute usually hits the prefix
cache) and it goes back to the head of the waiting queue.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from infergate.engine.interfaces import ScheduledBatch, ScheduledSeq
from infergate.engine.kv_cache_manager import KVCacheManager
from infergate.engine.request import Request, RequestStatus
from infergate.engine.sampler import bad_word_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    # Distinct LoRA adapters the running batch may hold (vLLM's --max-loras; 0: no LoRA).
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.max_loras < 0:
            raise ValueError("max_loras must not be negative")


@dataclass
class SchedulerOutput:
    batch: ScheduledBatch
    requests: list[Request]  # same order as batch.seqs
    preempted: list[Request]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Move a request to a finished state and give its blocks back."""
        if request.request_id not in self.requests:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            # Waiting (or preempted) requests hold no blocks; unlink from the queue.
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request, n):
                victim = self.running.pop()  # last admitted goes first
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chosen.append((request, n))
                budget -= n
                i += 1
                continue
            break  # the request preempted itself: nothing later can fit either

        if not preempted:
            loras = self.running_loras()
            skipped: list[Request] = []  # waiting on an adapter slot; keep their places
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if not self._lora_fits(request, loras):
                    skipped.append(self.waiting.popleft())
                    continue
                cached = self.kv.find_cached_prefix(request)
                num_cached = cached.num_tokens(self.kv.block_size)
                n = min(request.num_tokens - num_cached, budget)
                request.num_computed_tokens = num_cached
                if not self.kv.allocate(request, n, cached):
                    request.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                # Tokens a P/D transfer provided are not local prefix-cache hits.
                local_hit = max(0, num_cached - request.num_external_tokens)
                self.kv.record_lookup(request.num_tokens, local_hit)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = local_hit
                    request.scheduled_time = time.monotonic()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                if request.lora is not None:
                    loras.add(request.lora.name)
                chosen.append((request, n))
                budget -= n
            self.waiting.extendleft(reversed(skipped))

        seqs = [self._seq(request, n) for request, n in chosen]
        return SchedulerOutput(ScheduledBatch(seqs), [r for r, _ in chosen], preempted)

    def running_loras(self) -> set[str]:
        """Names of the adapters the running requests use."""
        return {r.lora.name for r in self.running if r.lora is not None}

    def waiting_loras(self) -> set[str]:
        return {r.lora.name for r in self.waiting if r.lora is not None}

    def _lora_fits(self, request: Request, loras: set[str]) -> bool:
        """A request whose adapter is not running is admitted only while the batch holds
        fewer than ``max_loras`` distinct adapters (vLLM skips it, keeping its place)."""
        if request.lora is None or request.lora.name in loras:
            return True
        return len(loras) < self.config.max_loras

    def _seq(self, request: Request, n: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        next_prompt: list[int] = []
        if request.sampling.prompt_logprobs is not None and start + n < request.num_prompt_tokens:
            next_prompt = request.prompt_token_ids[start + n : start + n + 1]
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + n],
            start_pos=start,
            block_table=self.kv.block_ids(request.request_id),
            sample=start + n == request.num_tokens,
            sampling=request.sampling,
            num_generated=request.num_output_tokens,
            next_prompt_ids=next_prompt,
            num_prompt_tokens=request.num_prompt_tokens,
            lora_name=request.lora.name if request.lora is not None else None,
            **_sampling_state(request),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Request]:
        """Advance computed counts, append sampled tokens, commit full blocks.

        Returns the requests that got a new token (the caller checks stop conditions).
        """
        got_token: list[Request] = []
        for request, seq, token in zip(out.requests, out.batch.seqs, sampled, strict=True):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(seq.token_ids)
            self.kv.commit_full_blocks(request)
            if token is not None:
                request.append_output_token(token)
                got_token.append(request)
        return got_token


def _sampling_state(request: Request) -> dict[str, Any]:
    """What the sampler needs beyond the params: history for penalties, min_tokens mask."""
    params = request.sampling
    state: dict[str, Any] = {}
    if params.needs_history:
        state["prompt_token_ids"] = request.prompt_token_ids
        state["output_token_ids"] = request.output_token_ids
    blocked: tuple[int, ...] = ()
    if request.num_output_tokens < params.min_tokens:
        blocked = (*sorted(request.eos_token_ids), *params.stop_token_ids)
    if params.bad_words_token_ids:
        blocked += bad_word_blocks(params.bad_words_token_ids, request.output_token_ids)
    if blocked:
        state["blocked_token_ids"] = blocked
    if request.grammar is not None:
        state["grammar"] = request.grammar
    return state
