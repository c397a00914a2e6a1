"""``/v1/chat/completions``: the chat template, ``n`` choices, chat logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from infergate.engine.core.engine_core import RequestOutput
from infergate.engine.entrypoints.openai_logprobs import chat_content, prompt_logprobs
from infergate.engine.entrypoints.protocol import ChatCompletionRequest
from infergate.engine.interfaces import TokenLogprob
from infergate.engine.tool_parsers import ToolCall
from infergate.engine.tool_parsers.choice import ToolChoiceError, plan_tools
from infergate.engine.tool_parsers.stream import ToolCallState

from .errors import APIError
from .responses import Choice, ResponsePlan, merge_streams, respond, stream_usage_flags
from .serving_engine import OpenAIServing, fork_siblings


class ChatChoice:
    """One chat choice: the assistant message, streamed as deltas or whole."""

    def __init__(self, index: int, prompt_ids: list[int], req: ChatCompletionRequest,
                 text: Callable[[int], str], tools: ToolCallState | None = None) -> None:  # fmt: skip
        self.index, self.prompt_index = index, 0
        self.prompt_ids, self.req, self.text = prompt_ids, req, text
        self.outs: list[RequestOutput] = []
        self.tools = tools if tools is not None and tools.active else None
        self.num_calls = 0  # tool calls streamed so far

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
        delta: dict[str, Any] = {"content": out.new_text} if out.new_text else {}
        if self.tools is not None:
            content, calls = self.tools.feed(out.new_text, out.finished)
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
                self.num_calls += sum(1 for c in calls if "id" in c)
        if not (delta or out.finished or out.logprobs):
            return None
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": self.logprobs(out.logprobs or []),
            "finish_reason": self.finish_reason(out, self.num_calls),
            "stop_reason": out.stop_reason,
        }

    def finish_reason(self, out: RequestOutput | None, num_calls: int) -> str | None:
        """``tool_calls`` when the model chose to call (auto, required), as OpenAI."""
        if out is None or not out.finished:
            return None
        if out.finish_reason == "stop" and self.tools is not None and num_calls:
            return "tool_calls" if self.tools.plan.mode in ("auto", "required") else "stop"
        return out.finish_reason

    def whole(self) -> dict[str, Any]:
        last = self.last
        text = "".join(o.new_text for o in self.outs)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: list[ToolCall] = []
        if self.tools is not None:
            message["content"], calls = self.tools.split(text)
            message["tool_calls"] = [c.openai() for c in calls]
        choice = {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs([e for o in self.outs for e in o.logprobs or []]),
            "finish_reason": self.finish_reason(last, len(calls)),
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
        order = self.queue_order(request, req)
        if not req.messages:
            raise APIError(400, "messages must not be empty.", "messages")
        try:
            tool_plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                              self.config.enable_auto_tool_choice)  # fmt: skip
        except ToolChoiceError as error:
            raise APIError(400, error.message, error.param) from None
        ids = await self.render_chat(
            req.messages, req.add_generation_prompt, tool_plan.template_tools()
        )
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        params = self.sampling_params(req, len(ids), max_tokens, None)
        grammar = await self.compile_grammar(self.tool_grammar(self.grammar_spec(req), tool_plan))
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
        requests = [
            self.new_request(f"{rid}-{j}", ids, p, req, grammar, order)
            for j, p in enumerate(children)
        ]
        fork_siblings(requests)
        await self.prepare_kv_transfer(request, req, "/v1/chat/completions", requests)
        streams = [self.engine.generate(r) for r in requests]
        parser = self.tool_parser()
        chat = [
            ChatChoice(j, ids, req, self.token_text, ToolCallState(tool_plan, parser))
            for j in range(n)
        ]
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
