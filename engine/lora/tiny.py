"""Random PEFT LoRA adapters for the tiny model (tests and demos; nothing downloaded).

Written in exactly PEFT's on-disk format (``adapter_config.json`` +
``adapter_model.safetensors``, keys ``base_model.model.<module>.lora_{A,B}.weight``), so
`peft` loads them onto the `transformers` model for reference checks. ``B`` is random
(PEFT initialises it to zero), so every adapter visibly changes the model's output.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Adapter i targets VARIANTS[i % len]: attention-only, MLP-only, everything.
VARIANTS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("q_proj", "k_proj", "v_proj", "o_proj"), 8),
    (("gate_proj", "up_proj", "down_proj"), 4),
    (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 16),
)


def make_tiny_lora(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    rank: int = 8,
    alpha: float | None = None,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    scale: float = 0.25,
) -> Path:
    """Write one random adapter for the model in ``model_dir``; return ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            a = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            b = torch.randn(fan_out, rank, generator=gen) * scale * rank**-0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def make_tiny_loras(
    model_dir: str | Path, count: int, *, seed: int = 0, out_root: str | Path | None = None
) -> list[Path]:
    """``count`` adapters under ``OUT_ROOT/loras/lora-<i>`` (default OUT_ROOT: the model
    directory), cycling through VARIANTS."""
    paths = []
    for i in range(count):
        targets, rank = VARIANTS[i % len(VARIANTS)]
        out = Path(out_root or model_dir) / "loras" / f"lora-{i}"
        paths.append(
            make_tiny_lora(model_dir, out, seed=seed + 1000 + i, rank=rank, target_modules=targets)
        )
    return paths
