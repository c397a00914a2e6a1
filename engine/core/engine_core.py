"""EngineCore: one synchronous step = schedule → run the batch → update → outputs.

It knows nothing about HTTP or threads (see :mod:`infergate.engine.async_engine`); it owns
the scheduler, the KV cache manager, the runner and per-request detokenization, so stop
strings end a request inside the step that produced them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infergate.engine.core.kv_cache_manager import KVCacheManager
from infergate.engine.core.request import Request, RequestStatus
from infergate.engine.core.scheduler import Scheduler, SchedulerConfig
from infergate.engine.interfaces import ModelRunner, TokenLogprob
from infergate.engine.kv_events import ZmqEventPublisher
from infergate.engine.lora.errors import LoRAError
from infergate.engine.lora.manager import LoRAManager, LoRARequest
from infergate.engine.metrics import EngineMetrics
from infergate.engine.tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from infergate.engine.kv_transfer.blocks import KVTransfer

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, plus totals for ``usage``)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed the request
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when asked for
    # Of prompt tokens 1.. (in the request's first output only), when asked for.
    prompt_logprobs: list[TokenLogprob] | None = None
    # P/D: a prefill held for a decode engine (vLLM's response field of that name).
    kv_transfer_params: dict[str, Any] | None = None


class _TextState:
    """Incremental text for one request; holds back a possible stop-string prefix."""

    def __init__(
        self, decoder: IncrementalDecoder | None, stops: tuple[str, ...], keep_stop: bool = False
    ) -> None:
        self.decoder = decoder
        self.stops = stops
        self.keep_stop = keep_stop  # include_stop_str_in_output
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def add(self, token_id: int, include: bool) -> str | None:
        """Append a token's text; returns the stop string if one appeared."""
        if self.decoder is None:
            return None
        piece = self.decoder.step([token_id])
        if not include or not piece:
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += piece
        hit: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self.text.find(stop, start)
            if idx >= 0 and (hit is None or idx < hit[0]):
                hit = (idx, stop)
        if hit is None:
            return None
        self.text = self.text[: hit[0] + (len(hit[1]) if self.keep_stop else 0)]
        return hit[1]

    def flush(self, stopped_by_token: bool) -> None:
        """End of the request: emit bytes the decoder still holds (incomplete UTF-8)."""
        if self.decoder is not None:
            self.text += self.decoder.flush(exclude_last=stopped_by_token)

    def delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        config: SchedulerConfig,
        *,
        tokenizer: Tokenizer | None = None,
        enable_prefix_caching: bool = True,
        metrics: EngineMetrics | None = None,
        kv_events: ZmqEventPublisher | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.runner = runner
        self.lora = lora  # the runner's adapter registry (None: LoRA disabled)
        self.config = config
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(
            runner.num_blocks,
            runner.block_size,
            enable_prefix_caching=enable_prefix_caching,
            enable_events=kv_events is not None,
        )
        self.scheduler = Scheduler(config, self.kv)
        self.metrics = metrics
        self.kv_events = kv_events
        self._text: dict[str, _TextState] = {}
        self._begin_step = getattr(runner, "begin_step", None)
        self._take_logprobs = getattr(runner, "take_logprobs", None)
        self._step_logprobs: dict[str, TokenLogprob] = {}
        self._stats_seen = (0, 0, 0)  # prefix queries, hits, preemptions already exported
        self.num_prompt_tokens = 0  # totals, for the periodic log line
        self.num_generation_tokens = 0
        #: P/D state (engine/kv_transfer), set when the engine has --kv-transfer-config.
        self.kv_transfer: KVTransfer | None = None
        if metrics is not None:
            metrics.bind(
                lambda: self.scheduler.num_running,
                lambda: self.scheduler.num_waiting,
                self.kv.usage,
                lambda: self.scheduler.pending_prefill_tokens,
                lambda: self.scheduler.waiting_prefill_tokens,
            )
            if lora is not None:
                metrics.bind_lora(
                    lambda: _retry(self.scheduler.running_loras),
                    lambda: _retry(self.scheduler.waiting_loras),
                    lora.max_loras,
                )

    # -- requests -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.lora is not None and (
            self.lora is None or self.lora.get(request.lora.name) != request.lora
        ):  # unloaded (or replaced) between the HTTP layer's lookup and now
            raise LoRAError(f"The lora adapter '{request.lora.name}' is no longer loaded.")
        if request.max_model_len is None:
            request.max_model_len = self.config.max_model_len
        decoder = None
        if self.tokenizer is not None:
            decoder = self.tokenizer.decode_stream(skip_special_tokens=request.skip_special_tokens)
        self._text[request.request_id] = _TextState(
            decoder, request.sampling.stop, request.sampling.include_stop_str_in_output
        )
        self.scheduler.add(request)
        payload, request.kv_payload = request.kv_payload, None
        if payload is not None and self.kv_transfer is not None:
            try:  # before any step: the scheduler's prefix lookup then finds the blocks
                self.kv_transfer.inject(request, payload)
            except Exception as error:  # the pulled KV is unusable: prefill locally
                self.kv_transfer.stats.rejected += 1
                log.warning("request %s: pulled KV not used (%s); prefilling locally",
                            request.request_id, error)  # fmt: skip

    # -- LoRA adapters (run on the engine thread, between steps) ------------------------
    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Register and load an adapter; LoRAError (a client error) when it cannot be."""
        if self.lora is None:
            raise LoRAError("LoRA is not enabled; start the engine with --enable-lora")
        return self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter; KeyError if unknown, LoRAError while requests use it."""
        if self.lora is None or self.lora.get(name) is None:
            raise KeyError(name)
        users = sum(
            1
            for r in self.scheduler.requests.values()
            if r.lora is not None and r.lora.name == name
        )
        if users:
            raise LoRAError(f"The lora adapter '{name}' is in use by {users} request(s)")
        self.lora.remove(name)

    def abort(self, request_id: str) -> None:
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._finished(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset_prefix_cache()
        self._publish_events()
        return ok

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every live request with an error (the runner broke)."""
        outputs = []
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self._finished(request)
            outputs.append(RequestOutput(request.request_id, [], "", True, "abort", error=message))
        return outputs

    # -- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._begin_step is not None:
            self._begin_step()
        sched = self.scheduler.schedule()
        if self.kv_transfer is not None and self.kv_transfer.pins:
            self.kv_transfer.after_schedule(sched.requests, self.scheduler)
        outputs: list[RequestOutput] = []
        if sched.batch.seqs:
            if self.metrics is not None:
                self.metrics.iteration_tokens.observe(sched.batch.num_tokens)
            sampled = self.runner.execute(sched.batch)
            if self._take_logprobs is not None:
                self._step_logprobs, prompt = self._take_logprobs()
                self._add_prompt_logprobs(prompt)
            now = time.monotonic()
            for request in self.scheduler.update_after_step(sched, sampled):
                outputs.append(self._on_token(request, now))
        self._export_stats()
        self._publish_events()
        return outputs

    def _add_prompt_logprobs(self, prompt: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        """Keep prompt logprobs in order; a recompute after preemption repeats positions."""
        for request_id, (first, entries) in prompt.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            have = request.prompt_logprobs
            skip = len(have) + 1 - first  # token index of entries[0] is `first`
            if 0 <= skip < len(entries):
                have.extend(entries[skip:])

    def _on_token(self, request: Request, now: float) -> RequestOutput:
        token = request.output_token_ids[-1]
        m = self.metrics
        self.num_generation_tokens += 1
        first_output = request.first_token_time is None
        if request.first_token_time is None:
            request.first_token_time = now
            self.num_prompt_tokens += request.num_prompt_tokens
            if m is not None:
                m.ttft.observe(now - request.arrival_time)
                m.prompt_tokens.inc(request.num_prompt_tokens)
        elif m is not None and request.last_token_time is not None:
            m.itl.observe(now - request.last_token_time)
        request.last_token_time = now
        if m is not None:
            m.generation_tokens.inc()

        finished = request.check_stop()
        state = self._text[request.request_id]
        # A stop token (EOS or stop_token_ids) ends the text without adding to it.
        stop_string = state.add(token, include=not finished or not _ended_by_token(request))
        if stop_string is not None:  # takes precedence over a simultaneous length limit
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_string
            finished = True
        elif finished:
            state.flush(stopped_by_token=_ended_by_token(request))
        out = RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            new_text=state.delta(finished),
            finished=finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        if request.sampling.logprobs is not None:
            entry = self._step_logprobs.get(request.request_id)
            out.logprobs = [entry] if entry is not None else []
        if first_output and request.sampling.prompt_logprobs is not None:
            out.prompt_logprobs = list(request.prompt_logprobs)
        if finished:
            params = request.kv_transfer_params
            if params and params.get("do_remote_decode") and self.kv_transfer is not None:
                out.kv_transfer_params = self.kv_transfer.hold(request)
            self.scheduler.finish(request, request.status)
            self._finished(request)
            if m is not None:
                m.request_completed(request, now)
        return out

    def stats_line(self, since: tuple[float, int, int]) -> tuple[str, tuple[float, int, int]]:
        """vLLM-style one-line summary of throughput and load since the last call."""
        now = (time.monotonic(), self.num_prompt_tokens, self.num_generation_tokens)
        elapsed = max(now[0] - since[0], 1e-9)
        hit_rate = self.kv.hits / self.kv.queries if self.kv.queries else 0.0
        line = (
            f"prompt throughput: {(now[1] - since[1]) / elapsed:.1f} tokens/s, "
            f"generation throughput: {(now[2] - since[2]) / elapsed:.1f} tokens/s, "
            f"running: {self.scheduler.num_running} reqs, waiting: {self.scheduler.num_waiting} "
            f"reqs, KV cache usage: {self.kv.usage():.1%}, prefix cache hit rate: {hit_rate:.1%}"
        )
        return line, now

    def _finished(self, request: Request) -> None:
        self._text.pop(request.request_id, None)
        if self.kv_transfer is not None:
            self.kv_transfer.unpin(request.request_id)
        try:
            self.runner.release(request.request_id)
        except Exception:  # a broken runner must not stop us from finishing requests
            log.exception("runner.release(%s) failed", request.request_id)
        if self.metrics is not None and request.status.finish_reason:
            self.metrics.request_finished(request.status.finish_reason)

    def _export_stats(self) -> None:
        m = self.metrics
        if m is None:
            return
        now = (self.kv.queries, self.kv.hits, self.scheduler.num_preemptions)
        q, h, p = (a - b for a, b in zip(now, self._stats_seen, strict=True))
        if q:
            m.prefix_queries.inc(q)
        if h:
            m.prefix_hits.inc(h)
        if p:
            m.preemptions.inc(p)
        self._stats_seen = now

    def _publish_events(self) -> None:
        if self.kv_events is not None:
            events = self.kv.pool.drain_events()
            if events:
                self.kv_events.publish(events)


def _retry(read: Callable[[], set[str]]) -> set[str]:
    """Read scheduler state from another thread (a scrape); a deque mutated mid-read
    raises, so try again (the engine thread changes it only briefly)."""
    for _ in range(10):
        try:
            return read()
        except RuntimeError:
            continue
    return set()


def _ended_by_token(request: Request) -> bool:
    """Finished because of EOS / a stop token id (whose text is not part of the output)."""
    return request.status is RequestStatus.FINISHED_STOPPED
