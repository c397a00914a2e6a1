"""The subset of a Hugging Face `config.json` our model code needs, validated up front.

Reading the JSON ourselves (rather than through `transformers.AutoConfig`) keeps the
serving path free of a heavy dependency and lets us reject what we cannot run with a
clear message instead of producing wrong tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise UnsupportedModelError("config.json has no 'architectures' entry")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            # transformers v5 folds rope_theta and rope_scaling into rope_parameters.
            rope_params = dict(cfg.get("rope_parameters") or {})
            rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
            scaling = cfg.get("rope_scaling") or rope_params or None
            return cls(
                architecture=str(archs[0]),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                rope_scaling=_normalize_rope_scaling(scaling),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_ids(cfg.get("eos_token_id")),
                raw=cfg,
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json is missing {e.args[0]!r}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json, merging stop tokens from generation_config.json when present."""
        d = Path(model_dir)
        path = d / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{d} has no config.json (is it a Hugging Face model dir?)")
        cfg = cls.from_dict(json.loads(path.read_text()))
        gen_path = d / "generation_config.json"
        if gen_path.is_file():
            gen_eos = _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
            merged = tuple(dict.fromkeys((*cfg.eos_token_ids, *gen_eos)))
            cfg = replace(cfg, eos_token_ids=merged)
        return cfg


def _as_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


_ROPE_TYPES = {"default", "llama3", "linear"}


def _normalize_rope_scaling(s: dict[str, Any] | None) -> dict[str, Any] | None:
    if not s:
        return None
    s = dict(s)
    kind = s.get("rope_type") or s.get("type") or "default"
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")
    s["rope_type"] = kind
    return None if kind == "default" else s
