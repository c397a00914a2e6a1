"""``/v1/models`` and ``/v1/models/{id}``: the served names (``--served-model-name``)."""

from __future__ import annotations

import time
from typing import Any

from .config import ServerConfig
from .errors import APIError


class OpenAIServingModels:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.created = int(time.time())

    def check_model(self, name: str | None) -> str:
        """The served name a request means (the first when it names none); 404 otherwise."""
        if name is None:
            return self.config.served_model_names[0]
        if name not in self.config.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return name

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "infergate",
                "root": self.config.model_dir, "parent": None,
                "max_model_len": self.config.max_model_len}  # fmt: skip

    def list(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card(n) for n in self.config.served_model_names]}

    def show(self, model_id: str) -> dict[str, Any]:
        return self.card(self.check_model(model_id))
