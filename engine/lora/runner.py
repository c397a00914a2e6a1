"""Attaching multi-LoRA to a model runner: real weights (torch) or names only (simulated)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .adapter import LoRAAdapter, load_adapter
from .layers import projection_shapes, wrap_model
from .manager import LoRAManager

if TYPE_CHECKING:
    from infergate.engine.interfaces import ScheduledSeq
    from infergate.engine.model_runner import TorchModelRunner


class TorchLoRA:
    """The torch runner's LoRA: wraps the model's projections and maps seqs to slots."""

    def __init__(
        self, runner: TorchModelRunner, *, max_loras: int, max_lora_rank: int,
        max_cpu_loras: int | None = None,
    ) -> None:  # fmt: skip
        model = runner.model
        self.device = runner.device
        self.state, self.wrapped = wrap_model(model, max_loras, max_lora_rank)
        shapes = projection_shapes(model)
        layers = runner.config.num_layers

        def loader(name: str, path: str) -> LoRAAdapter:
            return load_adapter(name, path, max_rank=max_lora_rank, num_layers=layers,
                                shapes=shapes)  # fmt: skip

        self.manager = LoRAManager(
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            loader=loader,
            write_slot=self._write_slot,
        )

    def _write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for layer, lin in self.wrapped:
            lin.set_slot(slot, adapter, layer)

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Set the per-token slot indices of this step (None when no seq uses an adapter)."""
        names = [s.lora_name for s in seqs]
        if not any(names):
            self.state.token_slots = None
            return
        slots, _ = self.manager.activate(n for n in names if n)
        per_seq = [slots[n] if n else -1 for n in names]
        counts = [len(s.token_ids) for s in seqs]
        self.state.token_slots = torch.repeat_interleave(
            torch.tensor(per_seq, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)
        ).to(self.device)


def attach_torch_lora(
    runner: TorchModelRunner, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None
) -> TorchLoRA:
    lora = TorchLoRA(runner, max_loras=max_loras, max_lora_rank=max_lora_rank,
                     max_cpu_loras=max_cpu_loras)  # fmt: skip
    runner.lora = lora
    return lora
