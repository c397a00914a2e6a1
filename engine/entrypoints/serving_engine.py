"""What every OpenAI API shares: reading and validating bodies, the model name,
tokenizing (off the event loop when long), the chat template, engine requests."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from fastapi import Request
from infergate.engine.async_engine import AsyncEngine
from infergate.engine.core.request import Request as EngineRequest
from infergate.engine.entrypoints.protocol import ChatMessage, _Sampling
from infergate.engine.interfaces import SamplingParams
from infergate.engine.kv_transfer.service import (
    BadKVParams,
    KVTransferService,
    apply_kv_transfer,
)
from infergate.engine.metrics import EngineMetrics
from infergate.engine.structured_output import GrammarSpec, GrammarSpecError, spec_from_request
from infergate.engine.structured_output.compiler import GrammarCompiler
from infergate.engine.structured_output.matcher import GrammarState
from infergate.engine.tokenizer import Tokenizer, TokenizerError
from infergate.engine.tool_parsers import ToolParser, get_parser
from infergate.engine.tool_parsers.choice import ToolPlan
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from infergate.wire.names import MAX_ORDER_DELAY_S, ORDER_DELAY_HEADER, PRIORITY_HEADER

from .config import LONG_TEXT_CHARS, ServerConfig
from .errors import APIError, ClientGone
from .sampling_params import check_token_ids, to_sampling_params
from .serving_models import OpenAIServingModels

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger("infergate.engine.server")


class QueueOrder(NamedTuple):
    """Where a request waits under priority scheduling: ``(priority, arrival + delay)``."""

    priority: int = 0
    delay: float = 0.0


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
        grammars: GrammarCompiler | None = None,
        kv_transfer: KVTransferService | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.config, self.metrics = engine, tokenizer, config, metrics
        self.models = models or OpenAIServingModels(config)
        self.grammars = grammars  # None: structured output is refused
        self.kv_transfer = kv_transfer
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
            extra = dict(message.model_extra or {})
            if isinstance(extra.get("tool_calls"), list):
                extra["tool_calls"] = [_template_call(c) for c in extra["tool_calls"]]
            plain.append({**extra, "role": message.role, "content": content or ""})
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
        params = to_sampling_params(req, self.config, prompt_len, max_tokens, default_max)
        if req.bad_words:
            params = replace(params, bad_words_token_ids=self.bad_words(req.bad_words))
        return params

    def bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's reading of ``bad_words``: each word tokenized as written (leading space
        stripped) and, when that tokenizes differently, with one leading space."""
        out: list[tuple[int, ...]] = []
        for word in words:
            if not word.strip():
                raise APIError(400, "bad_words entries must not be empty.", "bad_words")
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(bare)
            if spaced != bare and len(spaced) == len(bare):
                out.append(spaced)
        return tuple(out)

    async def compile_grammar(self, spec: GrammarSpec | None) -> CompiledGrammar | None:
        """The compiled grammar for `spec` (None: none asked); bad grammars are a 400."""
        if spec is None:
            return None
        if self.grammars is None:
            raise APIError(
                400,
                f"{spec.param}: structured output is not available in simulated mode.",
                spec.param,
            )
        try:
            return await self.grammars.compile(spec)
        except GrammarSpecError as error:
            raise APIError(400, error.message, error.param) from None

    def tool_parser(self) -> ToolParser | None:
        name = self.config.tool_call_parser
        return get_parser(name) if name is not None else None

    def tool_grammar(self, spec: GrammarSpec | None, plan: ToolPlan) -> GrammarSpec | None:
        """The grammar for a request whose own output constraint is `spec`, given its tools.

        ``required`` or a named function: the schema forcing the calls (never together
        with `spec`: a 400). ``auto`` with a fixed-markup parser, where grammars run (not in
        simulated mode) and nothing else constrains the output: the structural tag that
        keeps calls to offered functions. Otherwise `spec` itself.
        """
        schema = plan.schema()
        if schema is not None:
            if spec is not None:
                raise APIError(400, f"tool_choice {plan.mode!r} cannot be combined with "
                               f"{spec.param}.", "tool_choice")  # fmt: skip
            return GrammarSpec("json", json.dumps(schema, sort_keys=True), "tool_choice")
        parser = self.tool_parser()
        if spec is None and parser is not None and self.grammars is not None:
            tag = plan.auto_structural_tag(parser)
            if tag is not None:
                return GrammarSpec("structural_tag", json.dumps(tag, sort_keys=True), "tools")
        return spec

    def grammar_spec(self, req: _Sampling) -> GrammarSpec | None:
        try:
            return spec_from_request(req)
        except GrammarSpecError as error:
            raise APIError(400, error.message, error.param) from None

    def queue_order(self, request: Request, req: _Sampling) -> QueueOrder:
        """Where this call waits: its engine priority and its order delay, the EPP's
        ``x-infergate-order-delay`` (seconds, 0 to ``MAX_ORDER_DELAY_S``), read under
        priority scheduling only, like the priority header."""
        prioritized = self.config.scheduling_policy == "priority"
        priority = self._priority(request, req, prioritized)
        return QueueOrder(priority, self._order_delay(request, prioritized))

    @staticmethod
    def _priority(request: Request, req: _Sampling, prioritized: bool) -> int:
        """The engine priority of this call (vLLM's: lower runs first).

        The body's ``priority`` wins; without one, the EPP's ``x-infergate-priority``
        header (the InferenceObjective's priority, negated) is used under
        ``--scheduling-policy priority`` and ignored under fcfs, where a gateway's hint has
        nothing to act on. A non-zero body priority under fcfs is a 400, as in vLLM. Values
        must fit a signed 64-bit integer (what vLLM's engine-core messages carry).
        """
        if "priority" in req.model_fields_set:
            _check_priority(req.priority, "priority")
            if req.priority != 0 and not prioritized:
                raise APIError(
                    400,
                    f"priority {req.priority} needs priority scheduling; the engine runs "
                    "--scheduling-policy fcfs.",
                    "priority",
                )
            return req.priority
        raw = request.headers.get(PRIORITY_HEADER)
        if raw is None or not prioritized:
            return 0
        try:
            value = int(raw.strip())
        except ValueError:
            raise APIError(
                400, f"{PRIORITY_HEADER} must be an integer, got {raw!r}.", PRIORITY_HEADER
            ) from None
        _check_priority(value, PRIORITY_HEADER)
        return value

    @staticmethod
    def _order_delay(request: Request, prioritized: bool) -> float:
        """The EPP's ``x-infergate-order-delay`` in seconds; 0 without one or under fcfs."""
        raw = request.headers.get(ORDER_DELAY_HEADER)
        if raw is None or not prioritized:
            return 0.0
        try:
            value = float(raw.strip())
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= MAX_ORDER_DELAY_S:  # also refuses nan
            raise APIError(
                400,
                f"{ORDER_DELAY_HEADER} must be seconds from 0 to {MAX_ORDER_DELAY_S:g}, "
                f"got {raw!r}.",
                ORDER_DELAY_HEADER,
            )
        return value

    async def prepare_kv_transfer(
        self, request: Request, req: _Sampling, path: str, engine_requests: list[EngineRequest]
    ) -> None:
        """P/D (engine/kv_transfer): act on ``kv_transfer_params`` and on the EPP's
        ``x-prefiller-host-port`` — hold the KV for a decode engine, or prefill remotely and
        pull the KV before these requests reach the engine. Bad params are a 400."""
        body = req.model_dump(mode="json", exclude_unset=True)
        try:
            await apply_kv_transfer(self.kv_transfer, path, body, request.headers, engine_requests)
        except BadKVParams as error:
            raise APIError(400, str(error), error.param) from None

    def new_request(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        req: _Sampling,
        grammar: CompiledGrammar | None = None,
        order: QueueOrder = QueueOrder(),
    ) -> EngineRequest:
        return EngineRequest(
            priority=order.priority,
            order_delay=order.delay,
            grammar=GrammarState(grammar) if grammar is not None else None,
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=params,
            cache_salt=req.cache_salt,
            lora=self.models.lora_request(req.model),
            skip_special_tokens=req.skip_special_tokens,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_model_len=self.config.max_model_len,
        )


PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def _check_priority(value: int, param: str) -> None:
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise APIError(400, f"{param} must be a signed 64-bit integer, got {value}.", param)


def fork_siblings(requests: list[EngineRequest]) -> None:
    """Mark the n samples of one prompt so they share its prefill: every request after
    the first forks the first's block table (see Scheduler). Requests that need the
    logits of every prompt position (prompt_logprobs) compute their own prompt."""
    first = requests[0]
    if first.sampling.prompt_logprobs is not None:
        return
    for sibling in requests[1:]:
        sibling.fork_parent = first


def _template_call(call: Any) -> Any:
    """An assistant message's tool call for the chat template: ``arguments`` as an object
    (OpenAI sends a JSON text; HF templates render it with ``tojson``), as vLLM does."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except json.JSONDecodeError:
            return call
    return call


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
