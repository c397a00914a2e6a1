"""``/tokenize`` and ``/detokenize`` (vLLM's extensions; the EPP's precise scorer uses
/tokenize with the chat template)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from infergate.engine.entrypoints.protocol import DetokenizeRequest, TokenizeRequest

from .errors import APIError
from .serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: Request) -> dict[str, Any]:
        req = await self.parse_request(request, TokenizeRequest)
        self.check_model(req.model)
        if req.messages is not None:
            ids = await self.render_chat(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await self.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "Either 'prompt' or 'messages' is required.", "prompt")
        return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req = await self.parse_request(request, DetokenizeRequest)
        self.check_model(req.model)
        self.check_tokens(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}
