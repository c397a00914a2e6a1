"""Model classes by the Hugging Face `architectures[0]` name in config.json."""

from __future__ import annotations

from .config import ModelConfig, UnsupportedModelError
from .llama import LlamaForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise UnsupportedModelError(
            f"architecture {cfg.architecture!r} is not supported (supported: {known})"
        ) from None
