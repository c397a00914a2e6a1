"""``/v1/models`` and ``/v1/models/{id}``: the served names (``--served-model-name``) and
the LoRA adapters, each adapter's card naming its base model as ``parent`` (vLLM's)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .config import ServerConfig
from .errors import APIError

if TYPE_CHECKING:
    from infergate.engine.lora.manager import LoRAManager, LoRARequest


class OpenAIServingModels:
    def __init__(self, config: ServerConfig, lora: LoRAManager | None = None) -> None:
        self.config = config
        self.lora = lora  # the engine's adapter registry (read here, changed by the engine)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> str:
        """The served name or adapter a request means (the first served name when it names
        none); 404 otherwise."""
        if name is None:
            return self.config.served_model_names[0]
        if name not in self.config.served_model_names and self.lora_request(name) is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return name

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, if it names one."""
        if self.lora is None or name is None or name in self.config.served_model_names:
            return None
        return self.lora.get(name)

    def card(self, name: str) -> dict[str, Any]:
        adapter = self.lora_request(name)
        if adapter is not None:
            assert self.lora is not None
            parent = self.lora.parents.get(name) or self.config.served_model_names[0]
            return {"id": name, "object": "model", "created": self.created,
                    "owned_by": "infergate", "root": adapter.path, "parent": parent,
                    "max_model_len": self.config.max_model_len}  # fmt: skip
        return {"id": name, "object": "model", "created": self.created, "owned_by": "infergate",
                "root": self.config.model_dir, "parent": None,
                "max_model_len": self.config.max_model_len}  # fmt: skip

    def list(self) -> dict[str, Any]:
        names = list(self.config.served_model_names)
        if self.lora is not None:
            names += list(self.lora.registry)
        return {"object": "list", "data": [self.card(n) for n in names]}

    def show(self, model_id: str) -> dict[str, Any]:
        return self.card(self.check_model(model_id))
