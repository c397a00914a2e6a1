"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

A LoRA adapter replaces a frozen projection ``y = W x`` by ``y = W x + s · B (A x)`` with
``A: [r, in]``, ``B: [out, r]`` and the scale ``s = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with rsLoRA). PEFT stores ``A`` and ``B`` under
``base_model.model.<module path>.lora_A.weight`` / ``lora_B.weight``. We fold ``s`` into
``B`` at load time, so the serving math is just ``W x + B' (A x)``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LoRAError

#: The projections we can adapt (Hugging Face module names, as PEFT's target_modules).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_UNSUPPORTED = ("use_dora", "modules_to_save", "layers_to_transform", "layers_pattern",
                "rank_pattern", "alpha_pattern")  # fmt: skip


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU: ``(layer, module) → (A [r, in], scaled B [out, r])``."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def read_config(path: Path) -> dict[str, object]:
    """The adapter's ``adapter_config.json``, checked for what we serve (plain LoRA)."""
    cfg_path = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter path {path} does not exist or is not a directory")
    if not cfg_path.is_file():
        raise LoRAError(f"{path} has no {CONFIG_FILE}; is it a PEFT adapter directory?")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as error:
        raise LoRAError(f"cannot read {cfg_path}: {error}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise LoRAError(f"{cfg_path}: {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_path}: bias {cfg.get('bias')!r} is not supported (only 'none')")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{cfg_path}: r must be a positive integer, got {rank!r}")
    return cfg


def load_adapter(
    name: str,
    path: str | Path,
    *,
    max_rank: int,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
) -> LoRAAdapter:
    """Load and validate an adapter for a base model whose projections have ``shapes``.

    ``shapes`` maps a target module name to ``(in_features, out_features)``. Raises
    :class:`LoRAError` for anything that does not fit: a missing or corrupt file, a rank
    above ``max_rank``, a module or layer the model does not have, mismatched shapes.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    cfg = read_config(root)
    rank = int(cfg["r"])  # type: ignore[call-overload]
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))  # type: ignore[arg-type]
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAError(f"{root} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise LoRAError(f"cannot read {file}: {error}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"{file}: unexpected tensor {key!r} (only LoRA A/B of "
                            f"{', '.join(TARGETS)} are served)")  # fmt: skip
        layer, module, half = int(m[1]), m[2], m[3]
        if module not in shapes or layer >= num_layers:
            raise LoRAError(f"{file}: {key!r} targets a module the base model does not have")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    weights = {}
    for (layer, module), ab in sorted(halves.items()):
        a, b = ab.get("A"), ab.get("B")
        fan_in, fan_out = shapes[module]
        if a is None or b is None:
            raise LoRAError(f"{file}: layer {layer} {module} lacks lora_A or lora_B")
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoRAError(
                f"{file}: layer {layer} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do "
                f"not match rank {rank} and the base model's [{fan_out}, {fan_in}] projection"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{file}: layer {layer} {module} has non-finite weights")
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    if not weights:
        raise LoRAError(f"{file} holds no LoRA weights")
    return LoRAAdapter(name=name, path=str(root), rank=rank, weights=weights)
