"""Runtime LoRA loading: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

As in vLLM these routes exist only when the operator opts in with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (or ``1``): they let any client change what the
server runs. Loading reads and validates the adapter on the engine thread between steps;
a bad adapter (missing path, corrupt file, rank above ``--max-lora-rank``, a module the
base model lacks) is a 400 and the engine keeps serving.
"""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from infergate.engine.async_engine import AsyncEngine
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.lora.errors import LoRAError
from pydantic import BaseModel, ConfigDict

from .errors import APIError
from .serving_engine import OpenAIServing

ENV_FLAG = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(ENV_FLAG, "0").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str | None = None
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing) -> None:
    """Register the routes (the caller checks the opt-in and that LoRA is enabled)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = serving.parse(await serving.read_body(request), LoadLoRAAdapterRequest)
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "lora_name" if not name else "lora_path")  # fmt: skip
        if name in serving.config.served_model_names:
            raise APIError(400, f"'{name}' is the base model's name.", "lora_name")

        def load(core: EngineCore) -> None:
            core.add_lora(name, path)

        try:
            await engine.call(load)
        except LoRAError as error:
            raise APIError(400, str(error), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = serving.parse(await serving.read_body(request), UnloadLoRAAdapterRequest)
        name = req.lora_name
        if not name:
            raise APIError(400, "'lora_name' must be provided.", "lora_name")

        def unload(core: EngineCore) -> None:
            core.remove_lora(name)

        try:
            await engine.call(unload)
        except KeyError:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           "lora_name") from None  # fmt: skip
        except LoRAError as error:
            raise APIError(400, str(error), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
