"""Qwen3 dense: the Llama decoder plus RMSNorm over each head's q and k before RoPE."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
