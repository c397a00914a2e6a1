"""What every OpenAI API shares: reading and validating bodies, the model name,
tokenizing (off the event loop when long), the chat template, engine requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any, TypeVar

from fastapi import Request
from infergate.engine.async_engine import AsyncEngine
from infergate.engine.interfaces import SamplingParams
from infergate.engine.metrics import EngineMetrics
from infergate.engine.protocol import ChatMessage, _Sampling
from infergate.engine.request import Request as EngineRequest
from infergate.engine.tokenizer import Tokenizer, TokenizerError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .config import LONG_TEXT_CHARS, ServerConfig
from .errors import APIError, ClientGone
from .sampling_params import check_token_ids, to_sampling_params
from .serving_models import OpenAIServingModels

log = logging.getLogger("infergate.engine.server")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class OpenAIServing:
    """Base of the per-API serving classes; holds the engine, tokenizer and config."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        config: ServerConfig,
        metrics: EngineMetrics | None = None,
        models: OpenAIServingModels | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.config, self.metrics = engine, tokenizer, config, metrics
        self.models = models or OpenAIServingModels(config)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        """One token decoded on its own (special tokens kept), as logprobs show it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- bodies -----------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The whole body, capped at ``max_body_bytes`` (chunked uploads included)."""
        limit = self.config.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"Request body over {limit} bytes.")
                chunks.append(chunk)
        except ClientDisconnect:
            log.info("client disconnected during upload of %s (%d bytes read)",
                     request.url.path, size)  # fmt: skip
            raise ClientGone from None
        return b"".join(chunks)

    def parse(self, body: bytes, model: type[M]) -> M:
        """Strict validation; the first error becomes a 400 naming its top-level field.
        Unknown fields are ignored with one warning per name, as vLLM does."""
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as error:
            first = error.errors()[0]
            if first["type"] == "json_invalid":
                raise APIError(400, f"Invalid JSON body: {first['msg']}") from None
            if not first["loc"]:
                raise APIError(400, "The request body must be a JSON object.") from None
            param = str(first["loc"][0])  # union branches below it are noise
            raise APIError(400, f"Invalid value for '{param}': {first['msg']}", param) from None
        extra = sorted((parsed.model_extra or {}).keys())
        new = [name for name in extra if name not in self.config.warned_fields]
        if new:
            self.config.warned_fields.update(new)
            log.warning("ignoring unknown request fields: %s", ", ".join(new))
        return parsed

    async def parse_request(self, request: Request, model: type[M]) -> M:
        return self.parse(await self.read_body(request), model)

    def check_model(self, name: str | None) -> str:
        return self.models.check_model(name)

    def check_tokens(self, ids: list[int], param: str) -> None:
        check_token_ids(ids, self.config.vocab_size, param)

    def check_logprobs_supported(self, param: str) -> None:
        if not self.config.supports_logprobs:
            raise APIError(400, f"{param} are not available in simulated mode.", param)

    # -- tokens -----------------------------------------------------------------------
    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize; long texts on a worker thread so the event loop keeps serving.

        A text too long to fit even at the vocabulary's longest token per position is
        refused before any tokenizing: a 15 MB prompt costs a length check, not seconds
        of tokenizer time and gigabytes of encodings.
        """
        limit = self.config.max_model_len
        floor = len(text) // max(self.tokenizer.max_token_chars, 1)
        if floor > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has at least {floor} tokens ({len(text)} characters).",
                "prompt",
            )
        if len(text) < LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )

    def chat_text(self, messages: list[ChatMessage], add_generation_prompt: bool,
                  tools: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        """The chat template rendered over `messages` (text parts only)."""
        plain = []
        for message in messages:
            content = message.content
            if isinstance(content, list):
                if any(part.type != "text" for part in content):
                    raise APIError(400, "Only text content parts are supported.", "messages")
                content = "".join(part.text or "" for part in content)
            plain.append(
                {**(message.model_extra or {}), "role": message.role, "content": content or ""}
            )
        try:
            return self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except TokenizerError as error:
            raise APIError(400, str(error), "messages") from None
        except Exception as error:  # a template that fails on this input
            raise APIError(400, f"Could not apply the chat template: {error}", "messages") from None

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:  # fmt: skip
        text = self.chat_text(messages, add_generation_prompt, tools)
        return await self.encode(text, add_special_tokens=False)

    # -- engine requests ----------------------------------------------------------------
    def sampling_params(self, req: _Sampling, prompt_len: int, max_tokens: int | None,
                        default_max: int | None) -> SamplingParams:  # fmt: skip
        return to_sampling_params(req, self.config, prompt_len, max_tokens, default_max)

    def new_request(
        self, rid: str, prompt: list[int], params: SamplingParams, req: _Sampling
    ) -> EngineRequest:
        return EngineRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=params,
            cache_salt=req.cache_salt,
            skip_special_tokens=req.skip_special_tokens,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_model_len=self.config.max_model_len,
        )


async def run_to_end(request: Request, stream: AsyncIterator[T]) -> list[T] | None:
    """Collect a whole generation, aborting it if the client disconnects first."""

    async def collect() -> list[T]:
        return [out async for out in stream]

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None  # the client is gone; the generator's exit aborted the request
    return work.result()
