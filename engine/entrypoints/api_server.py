"""The FastAPI app: error handlers, the guard middleware, and the routes, each a thin
call into its API's serving class.

Bodies are read by hand (size-capped, then validated strictly from JSON) so that every
bad input gets OpenAI's error schema with the right status, never FastAPI's 422 shape.
A client that goes away — mid-stream or while waiting for a whole answer — aborts its
request, which frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from infergate.engine.async_engine import AsyncEngine, EngineDeadError
from infergate.engine.kv_transfer.service import KVTransferService
from infergate.engine.metrics import EngineMetrics
from infergate.engine.structured_output.compiler import GrammarCompiler
from infergate.engine.tokenizer import Tokenizer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from infergate import __version__

from .config import ServerConfig
from .errors import APIError, ClientGone
from .guard import Guard
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_lora import add_lora_routes, runtime_updates_allowed
from .serving_models import OpenAIServingModels
from .serving_responses import OpenAIServingResponses, add_responses_routes
from .serving_tokenization import OpenAIServingTokenization


def _add_error_handlers(app: FastAPI) -> None:
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

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, error: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is listening; nginx's code for it

    @app.exception_handler(EngineDeadError)
    async def on_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return APIError(503, str(error)).response()


def _add_ops_routes(app: FastAPI, engine: AsyncEngine, config: ServerConfig,
                    metrics: EngineMetrics | None) -> None:  # fmt: skip
    @app.get("/health")
    async def health() -> Response:
        if engine.healthy:
            return Response(status_code=200)
        return APIError(503, engine.dead or "engine not running").response()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        # ``name[]=…`` renders only those samples, as prometheus_client's exposition app
        # (vLLM's /metrics) does: the Endpoint Picker asks for the dozen it reads.
        names = request.query_params.getlist("name[]")
        body = metrics.render(names) if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if config.dev_mode:  # as vLLM's VLLM_SERVER_DEV_MODE: not a production route

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            if await engine.call(lambda core: core.reset_prefix_cache()):
                return Response(status_code=200)
            return APIError(
                400, "Cannot reset the prefix cache while requests are running."
            ).response()


def _add_api_routes(app: FastAPI, models: OpenAIServingModels,
                    tokenization: OpenAIServingTokenization,
                    completion: OpenAIServingCompletion, chat: OpenAIServingChat) -> None:  # fmt: skip
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return models.list()

    @app.get("/v1/models/{model_id:path}")
    async def show_model(model_id: str) -> dict[str, Any]:
        return models.show(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await tokenization.detokenize(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion.create(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat.create(request)


async def load_async_backend() -> None:
    """Load anyio's backend for the running event loop now, not on the first streamed
    response.

    Starlette's ``StreamingResponse`` runs in an anyio task group, and anyio imports its
    asyncio backend (a large module) on first use. That import held the event loop for
    150-350 ms of the first streamed request on each engine, with the step loop's first
    steps overrunning their modelled time beside it: on the routing lab's 2-core machine
    the first request per engine took 330-500 ms where the rest took 146, which set the
    p99 of a 120-request cell for every router (docs/benchmarks/routing.md).
    """
    async with anyio.create_task_group():
        pass


def build_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    config: ServerConfig,
    metrics: EngineMetrics | None = None,
    *,
    kv_transfer: KVTransferService | None = None,
) -> FastAPI:
    """The engine's HTTP app; its lifespan starts and stops the engine's step loop (and
    the P/D connector, when the engine has one)."""

    grammars = GrammarCompiler(tokenizer, config.vocab_size) if config.structured_output else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await load_async_backend()
        engine.start()
        try:
            yield
        finally:
            if kv_transfer is not None:
                await kv_transfer.stop()
            engine.shutdown()
            if grammars is not None:
                grammars.shutdown()

    app = FastAPI(title="infergate engine", version=__version__, lifespan=lifespan)
    app.add_middleware(Guard, config=config)
    _add_error_handlers(app)
    lora = engine.core.lora
    models = OpenAIServingModels(config, lora)
    shared = (engine, tokenizer, config, metrics, models, grammars, kv_transfer)
    _add_ops_routes(app, engine, config, metrics)
    tokenization = OpenAIServingTokenization(*shared)
    _add_api_routes(
        app,
        models,
        tokenization,
        OpenAIServingCompletion(*shared),
        OpenAIServingChat(*shared),
    )
    add_responses_routes(app, OpenAIServingResponses(*shared))
    if lora is not None and runtime_updates_allowed():
        add_lora_routes(app, engine, tokenization)
    return app
