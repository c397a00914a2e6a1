"""``/v1/completions``: prompt lists, echo (with prompt logprobs), ``n`` and ``best_of``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from infergate.engine.core.engine_core import RequestOutput
from infergate.engine.core.request import Request as EngineRequest
from infergate.engine.entrypoints.openai_logprobs import (
    CompletionLogprobs,
    merge_completion_blocks,
    prompt_logprobs,
)
from infergate.engine.entrypoints.protocol import CompletionRequest

from .config import DEFAULT_COMPLETION_MAX_TOKENS
from .errors import APIError
from .responses import Choice, ResponsePlan, merge_streams, respond, stream_usage_flags
from .serving_engine import OpenAIServing, fork_siblings


class CompletionChoice:
    """One /v1/completions choice: built up from engine outputs, streamed or whole."""

    def __init__(self, index: int, prompt_index: int, prompt_ids: list[int], prompt_text: str,
                 req: CompletionRequest, text: Callable[[int], str]) -> None:  # fmt: skip
        self.index, self.prompt_index = index, prompt_index
        self.prompt_ids, self.prompt_text, self.req, self.text = prompt_ids, prompt_text, req, text
        self.echo, self.echo_only = bool(req.echo), req.max_tokens == 0
        self.lp = CompletionLogprobs(text) if req.logprobs is not None else None
        self.with_top = (req.logprobs or 0) > 0
        self.parts: list[str] = []
        self.blocks: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.prompt_lp: list[Any] | None = None
        self.last: RequestOutput | None = None
        self.cumulative_logprob = 0.0  # of the sampled tokens, for best_of ranking

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return 0 if self.echo_only or self.last is None else self.last.num_output_tokens

    def add(self, out: RequestOutput) -> dict[str, Any] | None:
        first = self.last is None
        self.last = out
        self.cumulative_logprob += sum(e.logprob for e in out.logprobs or [])
        text, blocks = "", []
        if first:
            entries = out.prompt_logprobs or []
            if self.req.prompt_logprobs is not None:
                self.prompt_lp = prompt_logprobs(entries, self.text)
            if self.echo:
                text = self.prompt_text
                if self.lp is not None:
                    blocks.append(self.lp.block([None, *entries], self.prompt_ids, self.with_top))
        if not self.echo_only:
            text += out.new_text
            self.token_ids += out.new_token_ids
            if self.lp is not None:
                blocks.append(self.lp.block(out.logprobs or [], out.new_token_ids, self.with_top))
        self.parts.append(text)
        self.blocks += blocks
        if not text and not out.finished and not first and not blocks:
            return None
        choice = self._choice(text, blocks, out)
        if first and self.prompt_lp is not None:
            choice["prompt_logprobs"] = self.prompt_lp
        return choice

    def _choice(self, text: str, blocks: list[dict[str, Any]],
                out: RequestOutput | None) -> dict[str, Any]:  # fmt: skip
        finished = out is not None and out.finished
        return {
            "index": self.index, "text": text,
            "logprobs": merge_completion_blocks(blocks) if self.lp is not None else None,
            "finish_reason": None if out is None or not finished
            else ("length" if self.echo_only else out.finish_reason),
            "stop_reason": None if self.echo_only or out is None else out.stop_reason,
        }  # fmt: skip

    def whole(self) -> dict[str, Any]:
        choice = self._choice("".join(self.parts), self.blocks, self.last)
        if self.prompt_lp is not None:
            choice["prompt_logprobs"] = self.prompt_lp
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_ids
            choice["token_ids"] = self.token_ids
        return choice


def best_of_selector(num_prompts: int, best_of: int, n: int) -> Any:
    """Per prompt, the n of best_of samples with the highest cumulative logprob."""

    def select(choices: list[Choice]) -> list[Choice]:
        kept: list[Choice] = []
        for p in range(num_prompts):
            group = choices[p * best_of : (p + 1) * best_of]
            kept += sorted(group, key=lambda c: -getattr(c, "cumulative_logprob", 0.0))[:n]
        return kept

    return select


class OpenAIServingCompletion(OpenAIServing):
    async def prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Token ids and (for echo) text of each prompt: strings, ids, or lists of either."""
        raw = req.prompt
        many = isinstance(raw, list) and bool(raw) and isinstance(raw[0], (str, list))
        items: list[Any] = list(raw) if many else [raw]
        if not items:
            raise APIError(400, "The prompt is empty.", "prompt")
        prompts: list[list[int]] = []
        texts: list[str] = []
        for item in items:
            if isinstance(item, str):
                prompts.append(await self.encode(item))
                texts.append(item)
            else:
                ids = list(item)
                self.check_tokens(ids, "prompt")
                prompts.append(ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
                texts.append(text)
        return prompts, texts

    async def create(self, request: Request) -> Response:
        req = await self.parse_request(request, CompletionRequest)
        model = self.check_model(req.model)
        order = self.queue_order(request, req)
        prompts, texts = await self.prompts(req)
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise APIError(400, "max_tokens=0 is only allowed with echo=true.", "max_tokens")
        want_lp = req.logprobs is not None
        prompt_lp = req.prompt_logprobs
        if req.echo and want_lp:
            prompt_lp = max(prompt_lp or 0, req.logprobs or 0)
        n = req.n or 1
        best_of = max(req.best_of or n, n)
        spec = self.grammar_spec(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[tuple[int, EngineRequest]] = []
        grammar = None if echo_only else await self.compile_grammar(spec)
        for p_index, ids in enumerate(prompts):
            params = self.sampling_params(
                req, len(ids), 1 if echo_only else req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS
            )
            rank_lp = req.logprobs if req.logprobs is not None or best_of == n else 0
            params = replace(params, logprobs=rank_lp, prompt_logprobs=prompt_lp)
            samples = []
            for j in range(best_of):
                child = params if params.seed is None else replace(params, seed=params.seed + j)
                rid_j = f"{rid}-{len(jobs) + j}"
                samples.append(self.new_request(rid_j, ids, child, req, grammar, order))
            fork_siblings(samples)  # the samples of one prompt share its prefill
            jobs += [(p_index, r) for r in samples]
        if best_of > n:
            self.check_logprobs_supported("best_of")  # ranking needs the sampled logprobs
        if want_lp or prompt_lp is not None:
            self.check_logprobs_supported("logprobs" if want_lp else "prompt_logprobs")
        await self.prepare_kv_transfer(request, req, "/v1/completions", [r for _, r in jobs])
        if self.metrics is not None:
            self.metrics.request_accepted(n, 0 if echo_only else jobs[0][1].sampling.max_tokens)
        choices: list[Choice] = [
            CompletionChoice(index, p, prompts[p], texts[p], req, self.token_text)
            for index, (p, _) in enumerate(jobs)
        ]
        include_usage, continuous = stream_usage_flags(req)
        plan = ResponsePlan(
            base={
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
            },
            choices=choices,
            stream=merge_streams([self.engine.generate(r) for _, r in jobs]),
            include_usage=include_usage,
            continuous_usage=continuous,
            select=best_of_selector(len(prompts), best_of, n) if best_of > n else None,
        )
        return await respond(request, plan, bool(req.stream))
