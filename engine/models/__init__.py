"""Decoder models (Llama, Qwen3 dense) in torch, loaded from Hugging Face checkpoints."""

from __future__ import annotations

from .config import ModelConfig, UnsupportedModelError
from .llama import LlamaForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .registry import MODEL_REGISTRY, model_class

__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "UnsupportedModelError",
    "model_class",
]
