"""The OpenAI-compatible HTTP server (FastAPI), in front of :class:`AsyncEngine`.

Bodies are read by hand (size-capped, then validated strictly from JSON) so that every
bad input gets OpenAI's error schema with the right status, never FastAPI's 422 shape.
A client that goes away — mid-stream or while waiting for a whole answer — aborts its
request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from infergate.engine.async_engine import AsyncEngine, EngineDeadError
from infergate.engine.core import RequestOutput
from infergate.engine.interfaces import SamplingParams, TokenLogprob
from infergate.engine.metrics import EngineMetrics
from infergate.engine.openai_logprobs import (
    CompletionLogprobs,
    chat_content,
    merge_completion_blocks,
    prompt_logprobs,
)
from infergate.engine.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Sampling,
    unsupported,
)
from infergate.engine.request import Request as EngineRequest
from infergate.engine.tokenizer import Tokenizer, TokenizerError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from infergate import __version__

log = logging.getLogger("infergate.engine.server")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

MAX_BODY_BYTES = 16 * 2**20
DEFAULT_COMPLETION_MAX_TOKENS = 16
LONG_TEXT_CHARS = 16_384  # tokenize longer texts off the event loop


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_dir: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    # Cap on the default max_tokens (simulated engines never emit EOS on their own).
    default_max_tokens_cap: int | None = None
    supports_logprobs: bool = True  # False for the simulator, which has no logits
    # Defaults for omitted sampling fields (--generation-config), as vLLM applies them.
    generation_defaults: dict[str, float] = field(default_factory=dict)
    dev_mode: bool = False  # development routes (/reset_prefix_cache)
    warned_fields: set[str] = field(default_factory=set)


class _ClientGone(Exception):
    """The client went away before its request body was complete (already logged)."""


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), self.status)


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# Besides /v1/*: routes that read the model's tokenizer or change engine state.
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/reset_prefix_cache"})


def _needs_key(path: str) -> bool:
    return path.startswith("/v1") or path in KEYED_PATHS


class _Guard:
    """ASGI middleware: API key on /v1 (as vLLM), /tokenize, /detokenize and
    /reset_prefix_cache; a Content-Length cap; both before any work."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app, self.config = app, config
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error: APIError | None = None
            if (
                self.expected is not None
                and _needs_key(scope["path"])
                and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            ):
                error = APIError(401, "Invalid or missing API key.")
            length = headers.get(b"content-length", b"")
            if error is None and length.isdigit() and int(length) > self.config.max_body_bytes:
                error = APIError(413, f"Request body over {self.config.max_body_bytes} bytes.")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def merge_streams(
    streams: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several requests' outputs as (stream index, output), as they come.

    Closing the merged stream closes every input, which aborts unfinished requests.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as error:  # surfaced to the consumer
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class _CompletionChoice:
    """One /v1/completions choice: built up from engine outputs, streamed or whole."""

    def __init__(self, index: int, prompt_ids: list[int], prompt_text: str, echo: bool,
                 echo_only: bool, req: CompletionRequest,
                 text: Callable[[int], str]) -> None:  # fmt: skip
        self.index, self.prompt_ids, self.prompt_text = index, prompt_ids, prompt_text
        self.echo, self.echo_only, self.req, self.text = echo, echo_only, req, text
        self.lp = CompletionLogprobs(text) if req.logprobs is not None else None
        self.with_top = (req.logprobs or 0) > 0
        self.parts: list[str] = []
        self.blocks: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.prompt_lp: list[Any] | None = None
        self.last: RequestOutput | None = None
        self.cumulative_logprob = 0.0  # of the sampled tokens, for best_of ranking

    @property
    def completion_tokens(self) -> int:
        return 0 if self.echo_only or self.last is None else self.last.num_output_tokens

    @property
    def cached_tokens(self) -> int:
        return self.last.num_cached_tokens if self.last else 0

    def add(self, out: RequestOutput) -> dict[str, Any] | None:
        """Take one engine output; returns the streamed choice (None: nothing new)."""
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
        choice: dict[str, Any] = {
            "index": self.index, "text": text,
            "logprobs": merge_completion_blocks(blocks) if self.lp is not None else None,
            "finish_reason": self.finish_reason(out), "stop_reason": self.stop_reason(out),
        }  # fmt: skip
        if first and self.prompt_lp is not None:
            choice["prompt_logprobs"] = self.prompt_lp
        return choice

    def finish_reason(self, out: RequestOutput | None) -> str | None:
        if out is None or not out.finished:
            return None
        return "length" if self.echo_only else out.finish_reason

    def stop_reason(self, out: RequestOutput | None) -> int | str | None:
        return None if self.echo_only or out is None else out.stop_reason

    def whole(self) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": self.index, "text": "".join(self.parts),
            "logprobs": merge_completion_blocks(self.blocks) if self.lp is not None else None,
            "finish_reason": self.finish_reason(self.last),
            "stop_reason": self.stop_reason(self.last),
        }  # fmt: skip
        if self.prompt_lp is not None:
            choice["prompt_logprobs"] = self.prompt_lp
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_ids
            choice["token_ids"] = self.token_ids
        return choice


def sum_usage(per_prompt: Sequence[_CompletionChoice],
              choices: Sequence[_CompletionChoice]) -> dict[str, Any]:  # fmt: skip
    """OpenAI usage over a request: each prompt counted once, every choice's tokens."""
    prompt = sum(len(c.prompt_ids) for c in per_prompt)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in per_prompt)},
    }


def build_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    config: ServerConfig,
    metrics: EngineMetrics | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="infergate engine", version=__version__, lifespan=lifespan)
    created = int(time.time())

    app.add_middleware(_Guard, config=config)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and wrong methods in OpenAI's error shape, not FastAPI's."""
        message = (
            f"Route {request.method} {request.url.path} not found."
            if error.status_code == 404
            else str(error.detail)
        )
        return APIError(error.status_code, message).response()

    @app.exception_handler(_ClientGone)
    async def on_client_gone(request: Request, error: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's code for it

    @app.exception_handler(EngineDeadError)
    async def on_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return APIError(503, str(error)).response()

    # -- plumbing -------------------------------------------------------------------------
    async def read_body(request: Request) -> bytes:
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > config.max_body_bytes:
                    raise APIError(413, f"Request body over {config.max_body_bytes} bytes.")
                chunks.append(chunk)
        except ClientDisconnect:
            log.info("client disconnected during upload of %s (%d bytes read)",
                     request.url.path, size)  # fmt: skip
            raise _ClientGone from None
        return b"".join(chunks)

    def parse(body: bytes, model: type[M]) -> M:
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as error:
            first = error.errors()[0]
            if first["type"] == "json_invalid":
                raise APIError(400, f"Invalid JSON body: {first['msg']}") from None
            if not first["loc"]:
                raise APIError(400, "The request body must be a JSON object.") from None
            # OpenAI's ``param`` names the top-level field; union branches are noise.
            param = str(first["loc"][0])
            raise APIError(400, f"Invalid value for '{param}': {first['msg']}", param) from None
        extra = sorted((parsed.model_extra or {}).keys())
        new = [name for name in extra if name not in config.warned_fields]
        if new:
            config.warned_fields.update(new)
            log.warning("ignoring unknown request fields: %s", ", ".join(new))
        return parsed

    def check_model(name: str | None) -> str:
        if name is None:
            return config.served_model_names[0]
        if name not in config.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return name

    def check_tokens(ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"Token id {bad} is out of vocabulary (size {config.vocab_size}).", param
            )

    async def encode(text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize; long texts on a worker thread so the event loop keeps serving.

        A text too long to fit even at the vocabulary's longest token per position is
        refused before any tokenizing: a 15 MB prompt costs a length check, not seconds
        of tokenizer time and gigabytes of encodings.
        """
        floor = len(text) // max(tokenizer.max_token_chars, 1)
        if floor > config.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. "
                f"However, your prompt has at least {floor} tokens "
                f"({len(text)} characters).",
                "prompt",
            )
        if len(text) < LONG_TEXT_CHARS:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(
            tokenizer.encode, text, add_special_tokens=add_special_tokens
        )

    async def render_chat(messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
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
            text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
        except TokenizerError as error:
            raise APIError(400, str(error), "messages") from None
        except Exception as error:  # a template that fails on this input
            raise APIError(400, f"Could not apply the chat template: {error}", "messages") from None
        return await encode(text, add_special_tokens=False)

    def sampling_params(req: _Sampling, prompt_len: int, max_tokens: int | None,
                        default_max: int | None) -> SamplingParams:  # fmt: skip
        problem = unsupported(req)
        if problem is not None:
            raise APIError(400, problem[1], problem[0])
        if req.stream_options is not None and not req.stream:
            raise APIError(
                400, "stream_options is only allowed with stream=true.", "stream_options"
            )
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):  # fmt: skip
            value = getattr(req, name)
            if value is not None and not math.isfinite(value):
                raise APIError(400, f"{name} must be a finite number.", name)
        if req.temperature is not None and req.temperature < 0:
            raise APIError(400, "temperature must be non-negative.", "temperature")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(req, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise APIError(400, f"{name} must be in [-2, 2].", name)
        if req.repetition_penalty is not None and req.repetition_penalty <= 0:
            raise APIError(400, "repetition_penalty must be positive.", "repetition_penalty")
        if req.min_p is not None and not 0 <= req.min_p <= 1:
            raise APIError(400, "min_p must be in [0, 1].", "min_p")
        if req.min_tokens is not None and req.min_tokens < 0:
            raise APIError(400, "min_tokens must be non-negative.", "min_tokens")
        if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
            raise APIError(400, "min_tokens must not exceed max_tokens.", "min_tokens")
        bias = parse_logit_bias(req.logit_bias)
        if req.top_p is not None and not 0 < req.top_p <= 1:
            raise APIError(400, "top_p must be in (0, 1].", "top_p")
        if req.top_k is not None and req.top_k < -1:
            raise APIError(400, "top_k must be -1 (disabled) or a positive integer.", "top_k")
        if req.cache_salt is not None and not req.cache_salt:
            raise APIError(400, "cache_salt must be a non-empty string.", "cache_salt")
        if prompt_len == 0:
            raise APIError(400, "The prompt is empty.", "prompt")
        room = config.max_model_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. "
                f"However, your prompt has {prompt_len} tokens.",
                "prompt",
            )
        if max_tokens is not None:
            if max_tokens < 1:
                raise APIError(
                    400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens"
                )
            if max_tokens > room:
                raise APIError(
                    400,
                    f"This model's maximum context length is {config.max_model_len} tokens. "
                    f"However, you requested {prompt_len + max_tokens} tokens "
                    f"({prompt_len} in the prompt, {max_tokens} in the completion).",
                    "max_tokens",
                )
        stop_ids = tuple(req.stop_token_ids or ())
        check_tokens(list(stop_ids), "stop_token_ids")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        gen = config.generation_defaults
        return SamplingParams(
            temperature=gen.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=gen.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=int(gen.get("top_k", -1)) if req.top_k is None else req.top_k,
            seed=req.seed,
            max_tokens=max_tokens
            if max_tokens is not None
            else default_max_tokens(default_max, room),
            stop=tuple(s for s in stop if s),
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=gen.get("repetition_penalty", 1.0)
            if req.repetition_penalty is None
            else req.repetition_penalty,
            min_p=gen.get("min_p", 0.0) if req.min_p is None else req.min_p,
            logit_bias=bias,
            min_tokens=req.min_tokens or 0,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )

    def parse_logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias in [-100, 100]} as (id, bias) pairs."""
        out = []
        for key, value in (raw or {}).items():
            if not key.lstrip("-").isdigit():
                raise APIError(400, f"logit_bias key {key!r} is not a token id.", "logit_bias")
            token = int(key)
            if not 0 <= token < config.vocab_size:
                raise APIError(400, f"logit_bias token {token} is out of vocabulary.",
                               "logit_bias")  # fmt: skip
            if not (math.isfinite(value) and -100 <= value <= 100):
                raise APIError(400, "logit_bias values must be in [-100, 100].", "logit_bias")
            out.append((token, float(value)))
        return tuple(out)

    def default_max_tokens(default: int | None, room: int) -> int:
        value = min(default or room, room)
        if config.default_max_tokens_cap is not None:
            value = min(value, config.default_max_tokens_cap)
        return value

    def new_request(
        rid: str, prompt: list[int], params: SamplingParams, req: _Sampling
    ) -> EngineRequest:
        return EngineRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=params,
            cache_salt=req.cache_salt,
            skip_special_tokens=req.skip_special_tokens,
            eos_token_ids=tokenizer.eos_token_ids,
            max_model_len=config.max_model_len,
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

    def token_ids(req: _Sampling, prompt: list[int], outs: list[RequestOutput]) -> dict[str, Any]:
        if not req.return_token_ids:
            return {}
        return {"prompt_token_ids": prompt, "token_ids": [t for o in outs for t in o.new_token_ids]}

    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any] | None:
        return {"content": chat_content(entries, token_text)} if entries else None

    def chat_prompt_logprobs(first: RequestOutput | None) -> dict[str, Any]:
        if first is None or first.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(first.prompt_logprobs, token_text)}

    def check_logprobs_supported(param: str) -> None:
        if not config.supports_logprobs:
            raise APIError(400, f"{param} are not available in simulated mode.", param)

    def sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

    def check_error(out: RequestOutput) -> None:
        if out.error is not None:
            raise APIError(500, out.error)

    # -- endpoints --------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if engine.healthy:
            return Response(status_code=200)
        return APIError(503, engine.dead or "engine not running").response()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "infergate",
                "root": config.model_dir, "parent": None,
                "max_model_len": config.max_model_len}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in config.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        return model_card(check_model(model_id))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse(await read_body(request), TokenizeRequest)
        check_model(req.model)
        if req.messages is not None:
            ids = await render_chat(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "Either 'prompt' or 'messages' is required.", "prompt")
        return {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse(await read_body(request), DetokenizeRequest)
        check_model(req.model)
        check_tokens(req.tokens, "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    if config.dev_mode:  # as vLLM's VLLM_SERVER_DEV_MODE: not a production route

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            if await engine.call(lambda core: core.reset_prefix_cache()):
                return Response(status_code=200)
            return APIError(
                400, "Cannot reset the prefix cache while requests are running."
            ).response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(await read_body(request), CompletionRequest)
        model = check_model(req.model)
        raw = req.prompt
        many = isinstance(raw, list) and bool(raw) and isinstance(raw[0], (str, list))
        items: list[Any] = list(raw) if many else [raw]
        if not items:
            raise APIError(400, "The prompt is empty.", "prompt")
        prompts: list[list[int]] = []
        texts: list[str] = []
        for item in items:
            if isinstance(item, str):
                prompts.append(await encode(item))
                texts.append(item)
            else:
                ids = list(item)
                check_tokens(ids, "prompt")
                prompts.append(ids)
                texts.append(tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise APIError(400, "max_tokens=0 is only allowed with echo=true.", "max_tokens")
        want_lp = req.logprobs is not None
        prompt_lp = req.prompt_logprobs
        if req.echo and want_lp:
            prompt_lp = max(prompt_lp or 0, req.logprobs or 0)
        n = req.n or 1
        best_of = max(req.best_of or n, n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs: list[tuple[int, EngineRequest]] = []
        for p_index, ids in enumerate(prompts):
            params = sampling_params(
                req, len(ids), 1 if echo_only else req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS
            )
            rank_lp = req.logprobs if req.logprobs is not None or best_of == n else 0
            params = replace(params, logprobs=rank_lp, prompt_logprobs=prompt_lp)
            for j in range(best_of):
                child = params if params.seed is None else replace(params, seed=params.seed + j)
                jobs.append((p_index, new_request(f"{rid}-{len(jobs)}", ids, child, req)))
        if best_of > n:
            check_logprobs_supported("best_of")  # ranking needs the sampled tokens' logprobs
        if want_lp or prompt_lp is not None:
            check_logprobs_supported("logprobs" if want_lp else "prompt_logprobs")
        if metrics is not None:
            metrics.request_accepted(n, 0 if echo_only else jobs[0][1].sampling.max_tokens)
        now = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": now, "model": model}
        choices = [
            _CompletionChoice(index, prompts[p], texts[p], bool(req.echo), echo_only, req,
                              token_text)
            for index, (p, _) in enumerate(jobs)
        ]  # fmt: skip
        stream = merge_streams([engine.generate(r) for _, r in jobs])

        def total_usage() -> dict[str, Any]:
            first: dict[
                int, _CompletionChoice
            ] = {}  # one prompt count per prompt, however many samples it has
            for (p, _), c in zip(jobs, choices, strict=True):
                first.setdefault(p, c)
            return sum_usage(list(first.values()), choices)

        if not req.stream:
            outs = await run_to_end(request, stream)
            if outs is None:
                return Response(status_code=499)  # nginx's "client closed request"
            for index, out in outs:
                check_error(out)
                choices[index].add(out)
            kept = choices
            if best_of > n:  # per prompt, the n samples with the highest cumulative logprob
                kept = []
                for p in range(len(prompts)):
                    group = choices[p * best_of : (p + 1) * best_of]
                    kept += sorted(group, key=lambda c: -c.cumulative_logprob)[:n]
            body = []
            for index, choice in enumerate(kept):
                choice.index = index
                body.append(choice.whole())
            return JSONResponse({**base, "choices": body, "usage": total_usage()})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(
            req.stream_options and req.stream_options.continuous_usage_stats
        )

        async def events() -> AsyncIterator[str]:
            try:
                async for index, out in stream:
                    if out.error is not None:
                        yield sse(error_body(500, out.error))
                        break
                    delta = choices[index].add(out)
                    if delta is None:
                        continue
                    chunk = {**base, "choices": [delta]}
                    if include_usage:
                        chunk["usage"] = total_usage() if continuous else None
                    yield sse(chunk)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": total_usage()})
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(await read_body(request), ChatCompletionRequest)
        model = check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty.", "messages")
        ids = await render_chat(req.messages, req.add_generation_prompt)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        params = sampling_params(req, len(ids), max_tokens, None)
        n = req.n or 1
        if req.logprobs or req.prompt_logprobs is not None:
            check_logprobs_supported("logprobs" if req.logprobs else "prompt_logprobs")
        params = replace(
            params,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            prompt_logprobs=req.prompt_logprobs,
        )
        if metrics is not None:
            metrics.request_accepted(n, params.max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        children = [
            params if params.seed is None else replace(params, seed=params.seed + j)
            for j in range(n)
        ]
        stream = merge_streams(
            [
                engine.generate(new_request(f"{rid}-{j}", ids, p, req))
                for j, p in enumerate(children)
            ]
        )
        now = int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": now, "model": model}
        lasts: list[RequestOutput | None] = [None] * n

        def total_usage() -> dict[str, Any]:
            """The prompt once, every choice's output tokens (as vLLM sums them)."""
            done = [o for o in lasts if o is not None]
            completion = sum(o.num_output_tokens for o in done)
            cached = done[0].num_cached_tokens if done else 0
            return {
                "prompt_tokens": len(ids), "completion_tokens": completion,
                "total_tokens": len(ids) + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }  # fmt: skip

        if not req.stream:
            tagged = await run_to_end(request, stream)
            if tagged is None:
                return Response(status_code=499)  # nginx's "client closed request"
            per: list[list[RequestOutput]] = [[] for _ in range(n)]
            for index, out in tagged:
                check_error(out)
                per[index].append(out)
                lasts[index] = out
            choices = []
            for index, outs in enumerate(per):
                last = outs[-1] if outs else None
                choices.append({
                    "index": index,
                    "message": {"role": "assistant", "content": "".join(o.new_text for o in outs)},
                    "logprobs": chat_logprobs([e for o in outs for e in o.logprobs or []]),
                    "finish_reason": last.finish_reason if last else None,
                    "stop_reason": last.stop_reason if last else None,
                    **token_ids(req, ids, outs),
                })  # fmt: skip
            return JSONResponse({
                **base, "choices": choices, "usage": total_usage(),
                **chat_prompt_logprobs(per[0][0] if per[0] else None),
            })  # fmt: skip

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(
            req.stream_options and req.stream_options.continuous_usage_stats
        )
        chunk_base = {**base, "object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict[str, Any], out: RequestOutput | None) -> str:
            body: dict[str, Any] = {**chunk_base, "choices": [{
                "index": index, "delta": delta,
                "logprobs": chat_logprobs(out.logprobs or []) if out else None,
                "finish_reason": out.finish_reason if out else None,
                "stop_reason": out.stop_reason if out else None,
            }]}  # fmt: skip
            if include_usage:
                body["usage"] = total_usage() if continuous and out else None
            return sse(body)

        async def events() -> AsyncIterator[str]:
            try:
                for index in range(n):
                    yield chunk(index, {"role": "assistant", "content": ""}, None)
                async for index, out in stream:
                    lasts[index] = out
                    if out.error is not None:
                        yield sse(error_body(500, out.error))
                        break
                    if out.new_text or out.finished or out.logprobs:
                        delta = {"content": out.new_text} if out.new_text else {}
                        yield chunk(index, delta, out)
                if include_usage:
                    yield sse({**chunk_base, "choices": [], "usage": total_usage()})
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
