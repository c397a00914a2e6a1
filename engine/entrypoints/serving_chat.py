"""``/v1/chat/completions``: the chat template, ``n`` choices, chat logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from infergate.engine.core import RequestOutput
from infergate.engine.interfaces import TokenLogprob
from infergate.engine.openai_logprobs import chat_content, prompt_logprobs
from infergate.engine.protocol import ChatCompletionRequest

from .errors import APIError
from .responses import Choice, ResponsePlan, merge_streams, respond, stream_usage_flags
from .serving_engine import OpenAIServing


class ChatChoice:
    """One chat choice: the assistant message, streamed as deltas or whole."""

    def __init__(self, index: int, prompt_ids: list[int], req: ChatCompletionRequest,
                 text: Callable[[int], str]) -> None:  # fmt: skip
        self.index, self.prompt_index = index, 0
        self.prompt_ids, self.req, self.text = prompt_ids, req, text
        self.outs: list[RequestOutput] = []

    @property
    def last(self) -> RequestOutput | None:
        return self.outs[-1] if self.outs else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return self.last.num_output_tokens if self.last else 0

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        return {"content": chat_content(entries, self.text)} if entries else None

    def add(self, out: RequestOutput) -> dict[str, Any] | None:
        self.outs.append(out)
        if not (out.new_text or out.finished or out.logprobs):
            return None
        return {
            "index": self.index,
            "delta": {"content": out.new_text} if out.new_text else {},
            "logprobs": self.logprobs(out.logprobs or []),
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }

    def whole(self) -> dict[str, Any]:
        last = self.last
        choice = {
            "index": self.index,
            "message": {"role": "assistant", "content": "".join(o.new_text for o in self.outs)},
            "logprobs": self.logprobs([e for o in self.outs for e in o.logprobs or []]),
            "finish_reason": last.finish_reason if last else None,
            "stop_reason": last.stop_reason if last else None,
        }
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_ids
            choice["token_ids"] = [t for o in self.outs for t in o.new_token_ids]
        return choice

    def preamble(self) -> dict[str, Any]:
        """The first streamed chunk of a choice: the role, as OpenAI sends it."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None, "stop_reason": None}  # fmt: skip


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: Request) -> Response:
        req = await self.parse_request(request, ChatCompletionRequest)
        model = self.check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty.", "messages")
        ids = await self.render_chat(req.messages, req.add_generation_prompt)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        params = self.sampling_params(req, len(ids), max_tokens, None)
        n = req.n or 1
        if req.logprobs or req.prompt_logprobs is not None:
            self.check_logprobs_supported("logprobs" if req.logprobs else "prompt_logprobs")
        params = replace(
            params,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            prompt_logprobs=req.prompt_logprobs,
        )
        if self.metrics is not None:
            self.metrics.request_accepted(n, params.max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        children = [
            params if params.seed is None else replace(params, seed=params.seed + j)
            for j in range(n)
        ]
        streams = [
            self.engine.generate(self.new_request(f"{rid}-{j}", ids, p, req))
            for j, p in enumerate(children)
        ]
        chat = [ChatChoice(j, ids, req, self.token_text) for j in range(n)]
        choices: list[Choice] = list(chat)

        def extra() -> dict[str, Any]:
            first = chat[0].outs[0] if chat[0].outs else None
            if first is None or first.prompt_logprobs is None:
                return {}
            return {"prompt_logprobs": prompt_logprobs(first.prompt_logprobs, self.token_text)}

        include_usage, continuous = stream_usage_flags(req)
        plan = ResponsePlan(
            base={
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
            },
            choices=choices,
            stream=merge_streams(streams),
            include_usage=include_usage,
            continuous_usage=continuous,
            chunk_object="chat.completion.chunk",
            preamble=[c.preamble() for c in chat],
            extra=extra,
        )
        return await respond(request, plan, bool(req.stream))
