"""Continuous batching with a per-step token budget (vLLM V1's scheduling, simplified).

Every step, running requests go first — a decode costs one token, a partly prefilled
prompt continues with its next chunk — then waiting requests are admitted in queue order
while the token budget, ``max_num_seqs`` and free KV blocks allow; a prompt longer than
what is left of the budget is prefilled in chunks over several steps. There is no
separate prefill phase: "tokens to compute" is simply ``num_tokens -
num_computed_tokens``. When a running request cannot get a block, a running request is
preempted (the policy picks which, below): its blocks are freed (their cached hashes
survive, so its recompute usually hits the prefix cache) and it goes back to the waiting
queue.

``--scheduling-policy`` (vLLM's flag) orders the waiting queue (waiting_queue.py)
and picks the preemption victim: under ``fcfs`` the most recently admitted request, under
``priority`` the running request with the highest ``(priority, arrival_time +
order_delay)``, i.e. the least important and, among equals, the latest (a long prefill's
order delay makes it later).

``n > 1`` forks the block table: the extra sequences of a request wait until the first has
computed the prompt, then share its prompt blocks (``KVCacheManager.fork``) and compute
only the last prompt token themselves; the block copy that takes is carried in the batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from infergate.engine.core.kv_cache_manager import KVCacheManager
from infergate.engine.core.request import Request, RequestStatus
from infergate.engine.core.waiting_queue import SchedulingPolicy, WaitingQueue, priority_key
from infergate.engine.interfaces import ScheduledBatch, ScheduledSeq
from infergate.engine.sampler import bad_word_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    # Distinct LoRA adapters the running batch may hold (vLLM's --max-loras; 0: no LoRA).
    max_loras: int = 0
    # vLLM's --scheduling-policy: fcfs, or priority (lower request priority first).
    policy: SchedulingPolicy = "fcfs"

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
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        cached = self.kv.find_cached_prefix(request).num_tokens(self.kv.block_size)
        request.arrival_uncached_tokens = max(0, request.num_prompt_tokens - cached)
        self.requests[request.request_id] = request
        self.waiting.add(request)

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

    @property
    def waiting_prefill_tokens(self) -> int:
        """Prompt tokens of waiting requests that were not in the prefix cache when each
        arrived: the prefill queued behind the running requests' (an estimate: blocks a
        request ahead computes for them, or evictions since, are not counted). Read from
        the load reporter's thread, as ``pending_prefill_tokens`` is."""
        return sum(request.arrival_uncached_tokens for request in list(self.waiting))

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens of running requests whose KV is not computed yet: ``Σ (prompt −
        computed)``. A request's computed count advances after its step, so a prefill in
        progress counts until it is done. Waiting requests are left out: their prefix hit
        is known only at admission, and a hit waiting one step would read as a long
        prefill (their count is reported apart, as ``waiting``).

        Why: a router that did not send those requests (another EPP replica) sees from
        this how much prefill stands between a new request and its first token. Read
        from the load reporter's thread while the step thread runs: the copy keeps the
        iteration safe, and a sum that misses one change is one tick old, as any sample."""
        return sum(
            max(0, request.num_prompt_tokens - request.num_computed_tokens)
            for request in list(self.running)
        )

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
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:  # (priority) already scheduled this step: take it back out
                    i -= 1
                    budget += _unschedule(chosen, victim)
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

        copies: list[tuple[int, int]] = []
        if not preempted:
            budget = self._admit(chosen, copies, budget)

        seqs = [self._seq(request, n) for request, n in chosen]
        batch = ScheduledBatch(seqs, block_copies=copies)
        return SchedulerOutput(batch, [r for r, _ in chosen], preempted)

    def _admit(
        self, chosen: list[tuple[Request, int]], copies: list[tuple[int, int]], budget: int
    ) -> int:
        """Move waiting requests, in queue order, into the running batch while the budget,
        ``max_num_seqs`` and free blocks allow; returns the budget left."""
        loras = self.running_loras()
        skipped: list[Request] = []  # to be admitted later; they keep their places
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._lora_fits(request, loras) or self._fork_pending(request):
                skipped.append(self.waiting.pop())
                continue
            parent = request.fork_parent
            if parent is not None and self._forkable(request, parent):
                copy = self.kv.fork(request, parent)
                if copy is None:
                    break
                copies.append(copy)
                # Not a prefix-cache lookup: the sibling reports its prompt's hit.
                local_hit = max(parent.num_cached_tokens, 0)
                n = 1
            else:
                cached = self.kv.find_cached_prefix(request)
                num_cached = cached.num_tokens(self.kv.block_size)
                n = min(request.num_tokens - num_cached, budget)
                request.num_computed_tokens = num_cached
                if not self.kv.allocate(request, n, cached):
                    request.num_computed_tokens = 0
                    break
                # Tokens a P/D transfer provided are not local prefix-cache hits.
                local_hit = max(0, num_cached - request.num_external_tokens)
                self.kv.record_lookup(request.num_tokens, local_hit)
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = local_hit
                request.scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora is not None:
                loras.add(request.lora.name)
            chosen.append((request, n))
            budget -= n
        self.waiting.requeue(skipped)
        return budget

    def _victim(self) -> Request:
        """The running request to preempt: the last admitted (fcfs), or the one with the
        highest (priority, arrival + order delay) — least important, latest among equals
        (priority)."""
        if self.config.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _fork_pending(self, request: Request) -> bool:
        """An n > 1 sibling waits while the sequence it forks from has its prompt to
        compute (so the prompt is computed once, not once per sibling)."""
        parent = request.fork_parent
        if parent is None or request.num_computed_tokens or request.num_preemptions:
            return False
        live = self.requests.get(parent.request_id) is parent
        return live and parent.num_computed_tokens < parent.num_prompt_tokens

    def _forkable(self, request: Request, parent: Request) -> bool:
        """Share the parent's prompt blocks: it is running with its prompt computed and
        this sibling never ran (after a preemption the prefix cache does the sharing)."""
        return (
            parent.status is RequestStatus.RUNNING
            and parent.num_computed_tokens >= parent.num_prompt_tokens
            and request.num_computed_tokens == 0
            and request.num_preemptions == 0
            and self.requests.get(parent.request_id) is parent
        )

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
        self.waiting.requeue([request])

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


def _unschedule(chosen: list[tuple[Request, int]], request: Request) -> int:
    """Drop ``request`` from this step's batch; the tokens it was given."""
    at = next(k for k, (r, _) in enumerate(chosen) if r is request)
    return chosen.pop(at)[1]


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
