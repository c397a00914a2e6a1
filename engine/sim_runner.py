"""Simulated mode: the real scheduler and KV manager, a timing model instead of a GPU.

A step takes as long as the modelled GPU would, counted from the start of scheduling (so
the engine's own CPU work is inside the modelled time, not added to it), and produces
deterministic filler tokens that never include EOS — a simulated request always runs to
``max_tokens``. Because prefill time depends only on tokens actually computed, a prefix
cache hit shortens TTFT exactly as it does in the real engine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infergate.engine.interfaces import ScheduledBatch
from infergate.engine.lora.manager import LoRAManager

from infergate.options import option

#: The model the timing model describes (Llama-3-8B, bf16), as a Hugging Face config.
SIMULATED_MODEL_CONFIG: dict[str, Any] = {
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def kv_bytes_per_token(cfg: Mapping[str, Any]) -> int:
    """KV bytes one token takes: layers x 2 (K and V) x KV heads x head dim x dtype bytes.

    A block of ``block_size`` tokens is ``block_size`` times this; it is what a P/D
    transfer moves per block (simulated mode prices the transfer from it).
    """
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(
        cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    )
    dtype_bytes = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or "bfloat16"), 2)
    return int(cfg["num_hidden_layers"]) * 2 * heads * head_dim * dtype_bytes


# Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes per token.
KV_BYTES_PER_TOKEN_8B = kv_bytes_per_token(SIMULATED_MODEL_CONFIG)
H100_BYTES = 80 * 2**30
WEIGHTS_8B_BYTES = 16 * 2**30
ACTIVATION_RESERVE_BYTES = 2 * 2**30


def default_num_blocks(block_size: int, gpu_memory_utilization: float = 0.9) -> int:
    """KV blocks an H100 80GB holds for an 8B model, as vLLM would size it."""
    free = H100_BYTES * gpu_memory_utilization - WEIGHTS_8B_BYTES - ACTIVATION_RESERVE_BYTES
    return max(1, int(free // (KV_BYTES_PER_TOKEN_8B * block_size)))


@dataclass(frozen=True)
class TimingModel:
    """Step time of an H100 serving Llama-3-8B in bf16 (sources in docs/engine.md).

    ``max(base, compute)``: a step streams all weights once (memory bound, ``base_ms``)
    or, for many tokens, is compute bound: ``us_per_token`` per computed token plus
    ``ns_per_attention_pair`` per (query, key) pair of attention, which makes long
    prefills grow faster than linearly. On top: attention reading the KV of every
    scheduled sequence (``us_per_kv_token`` per token of context) and a per-sequence cost
    (sampling, bookkeeping).
    """

    base_ms: float = option(
        "--sim-base-ms",
        default=6.0,
        help="Simulated step floor: streaming the weights once (ms).",
    )
    us_per_token: float = option(
        "--sim-us-per-token", default=30.0, help="Simulated compute per scheduled token (µs)."
    )
    us_per_kv_token: float = option(
        "--sim-us-per-kv-token",
        default=0.05,
        help="Simulated attention KV read per context token (µs).",
    )
    us_per_seq: float = option(
        "--sim-us-per-seq", default=15.0, help="Simulated per-sequence cost per step (µs)."
    )
    ns_per_attention_pair: float = option(
        "--sim-ns-per-attention-pair",
        default=1.0,
        help="Simulated attention compute per (query, key) pair (ns).",
    )

    def step_seconds(self, batch: ScheduledBatch) -> float:
        tokens = 0
        kv = 0
        pairs = 0.0
        for seq in batch.seqs:
            n = len(seq.token_ids)
            tokens += n
            kv += seq.start_pos + n
            pairs += n * (seq.start_pos + (n + 1) / 2)  # causal: query i sees start_pos + i
        compute = tokens * self.us_per_token + pairs * self.ns_per_attention_pair / 1000.0
        us = (
            max(self.base_ms * 1000.0, compute)
            + kv * self.us_per_kv_token
            + len(batch.seqs) * self.us_per_seq
        )
        return us / 1e6


class SimulatedRunner:
    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        filler_token_ids: Sequence[int],
        timing: TimingModel | None = None,
        sleep: bool = True,
    ) -> None:
        if not filler_token_ids:
            raise ValueError("the simulator needs at least one ordinary token id")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.timing = timing or TimingModel()
        self._filler = list(filler_token_ids)
        self._sleep = sleep
        self._step_start: float | None = None
        self._deadline: float | None = None  # when the previous step was due to end
        self.steps = 0
        self.simulated_seconds = 0.0  # modelled time of all steps
        self.late_seconds = 0.0  # wall time beyond the modelled end of steps, summed
        # Multi-LoRA by name (no weights): bringing an adapter into one of the resident
        # slots costs `lora_load_seconds` of step time (host-to-device copy of its weights).
        self.lora: LoRAManager | None = None
        self.lora_load_seconds = 0.0
        self.lora_loads = 0

    def begin_step(self) -> None:
        """Mark the start of a step (called by the core before scheduling).

        When the engine goes straight on from the previous step, that step's CPU
        post-processing (outputs, detokenization) and this step's scheduling count inside
        this step's modelled time — as a GPU engine overlaps them with the forward pass —
        so back-to-back steps keep exactly the modelled pace.
        """
        now = time.perf_counter()
        back_to_back = (
            self._deadline is not None and now - self._deadline < self.timing.base_ms / 1000
        )
        self._step_start = self._deadline if back_to_back else now

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        # batch.block_copies (n > 1 copy-on-write) has no KV to copy here; a one-block
        # device copy is also far below the step time the model describes.
        duration = self.timing.step_seconds(batch) + self._lora_seconds(batch)
        self.steps += 1
        self.simulated_seconds += duration
        out: list[int | None] = []
        n = len(self._filler)
        for seq in batch.seqs:
            if seq.sample:
                pos = seq.start_pos + len(seq.token_ids)
                out.append(self._filler[(seq.token_ids[-1] * 31 + pos * 17) % n])
            else:
                out.append(None)
        if self._sleep:
            start = self._step_start if self._step_start is not None else time.perf_counter()
            deadline = start + duration
            remaining = deadline - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            self.late_seconds += max(0.0, time.perf_counter() - deadline)
            self._deadline = deadline
        self._step_start = None
        return out

    def _lora_seconds(self, batch: ScheduledBatch) -> float:
        """Modelled time to load the batch's adapters that are not resident (LRU slots)."""
        names = [s.lora_name for s in batch.seqs if s.lora_name]
        if not names:
            return 0.0
        if self.lora is None:
            raise ValueError("a sequence asks for a LoRA adapter but LoRA is not enabled")
        _, loaded = self.lora.activate(names)
        self.lora_loads += len(loaded)
        return len(loaded) * self.lora_load_seconds

    def release(self, request_id: str) -> None:
        """No per-request state to drop."""
