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
from functools import cached_property
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
class Gpu:
    """The datasheet figures a timing profile needs (dense bf16, no sparsity)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int
    #: vLLM's scheduler defaults on this GPU for its OpenAI server (``vllm/engine/arg_utils.py``
    #: ``get_batch_defaults``: 8192 tokens / 1024 sequences on >= 70 GiB GPUs other than
    #: A100, else 2048 / 256).
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class Model:
    """A decoder's shape: what its weights and its KV cost per token."""

    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: ``2 x layers x kv_heads x head_dim x dtype bytes``."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> float:
        """QK^T and PV for one (query, key) pair: ``2 x 2 x q_heads x head_dim`` per layer."""
        return 4.0 * self.layers * self.q_heads * self.head_dim


@dataclass(frozen=True)
class Profile:
    """A named GPU serving a named model with vLLM: a roofline with stated efficiencies.

    * prefill (compute bound): ``2 x params`` FLOPs per token at ``mfu x peak``, plus
      ``attention_flops_per_pair`` per causal (query, key) pair at the same rate;
    * decode step (memory bound): the weights streamed once, plus each scheduled token of
      context's KV, at ``bandwidth_efficiency x HBM bandwidth``;
    * ``seq_overhead_s`` per sequence per step: sampling and bookkeeping on the host;
    * KV capacity: ``(memory x gpu_memory_utilization - weights - activation reserve) ÷ KV
      bytes per token``, as vLLM sizes its cache after profiling a forward pass.

    The efficiencies are assumptions, not our measurements (docs/engine.md gives the
    published vLLM figures they were checked against).
    """

    name: str
    gpu: Gpu
    model: Model
    mfu: float = 0.55
    bandwidth_efficiency: float = 0.8
    seq_overhead_s: float = 15e-6
    activation_reserve_bytes: int = 2 * 2**30

    @property
    def prefill_s_per_token(self) -> float:
        return 2.0 * self.model.params / (self.mfu * self.gpu.peak_flops)

    @property
    def attention_s_per_pair(self) -> float:
        return self.model.attention_flops_per_pair / (self.mfu * self.gpu.peak_flops)

    @property
    def weights_s(self) -> float:
        """One low-batch decode step: every weight read once."""
        return self.model.weight_bytes / (self.bandwidth_efficiency * self.gpu.hbm_bytes_per_s)

    @property
    def kv_s_per_token(self) -> float:
        return self.model.kv_bytes_per_token / (
            self.bandwidth_efficiency * self.gpu.hbm_bytes_per_s
        )

    def kv_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        free = (
            self.gpu.memory_bytes * gpu_memory_utilization
            - self.model.weight_bytes
            - self.activation_reserve_bytes
        )
        return max(0, int(free // self.model.kv_bytes_per_token))


#: Datasheets: NVIDIA H100 SXM5 80GB (989.4 TFLOP/s dense bf16, 3.35 TB/s HBM3) and A100
#: SXM4 80GB (312 TFLOP/s dense bf16, 2.039 TB/s HBM2e).
H100_SXM = Gpu("H100 SXM 80GB", 989.4e12, 3.35e12, 80 * 2**30, 8192, 1024)
A100_SXM = Gpu("A100 SXM 80GB", 312e12, 2.039e12, 80 * 2**30, 2048, 256)
#: Llama-3.1-8B's config.json: 32 layers, 32 query heads, 8 KV heads of 128, 128k context.
LLAMA_31_8B = Model("Llama-3.1-8B (bf16)", 8.03e9, 32, 32, 8, 128, 131072)
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("h100-llama3.1-8b", H100_SXM, LLAMA_31_8B),
        Profile("a100-llama3.1-8b", A100_SXM, LLAMA_31_8B),
    )
}


def profile_named(name: str | None) -> str | None:
    """``--sim-profile``'s value checked against :data:`PROFILES` (ValueError naming them)."""
    if name is None or name in PROFILES:
        return name
    raise ValueError(f"unknown timing profile {name!r}: choose from {', '.join(PROFILES)}")


def _token_scale(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"{value:g} is not in (0, 1]")
    return value


@dataclass(frozen=True)
class StepCosts:
    """The step formula's coefficients, in seconds (see :meth:`TimingModel.costs`)."""

    floor: float
    per_token: float
    per_pair: float
    per_kv_token: float
    per_seq: float


@dataclass(frozen=True)
class TimingModel:
    """Step time of an H100 serving Llama-3-8B in bf16 (sources in docs/engine.md).

    ``max(base, compute)``: a step streams all weights once (memory bound, ``base_ms``)
    or, for many tokens, is compute bound: ``us_per_token`` per computed token plus
    ``ns_per_attention_pair`` per (query, key) pair of attention, which makes long
    prefills grow faster than linearly. On top: attention reading the KV of every
    scheduled sequence (``us_per_kv_token`` per token of context) and a per-sequence cost
    (sampling, bookkeeping).

    ``profile`` replaces the five coefficients by those of a named :class:`Profile`
    (a GPU and a model, derived from their datasheet figures). ``token_scale`` F < 1 makes
    each simulated token stand for 1/F real ones: per-token and per-step costs grow by
    1/F (per pair by 1/F²) and the KV cache shrinks by F, so a replay with every length
    scaled by F keeps each request's modelled prefill and decode time, and the cache's
    size relative to the work, with F times fewer tokens and steps for the host's CPU.
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
    profile: str | None = option(
        "--sim-profile",
        default=None,
        convert=profile_named,
        help="A named GPU and model whose datasheet roofline replaces the --sim-* step "
        f"costs and sizes the KV cache: {', '.join(PROFILES)}.",
    )
    token_scale: float = option(
        "--sim-token-scale",
        default=1.0,
        convert=_token_scale,
        help="Each simulated token stands for 1/F real ones (0 < F <= 1): step costs x 1/F "
        "(attention pairs 1/F^2), KV cache x F, for replays whose lengths are scaled by F.",
    )

    def __post_init__(self) -> None:
        profile_named(self.profile)
        _token_scale(self.token_scale)

    @cached_property
    def _costs(self) -> StepCosts:
        return self.costs()

    def costs(self) -> StepCosts:
        """The coefficients in seconds: the profile's or the flags', at ``token_scale``."""
        if self.profile is not None:
            p = PROFILES[self.profile]
            raw = StepCosts(p.weights_s, p.prefill_s_per_token, p.attention_s_per_pair,
                            p.kv_s_per_token, p.seq_overhead_s)  # fmt: skip
        else:
            raw = StepCosts(self.base_ms / 1e3, self.us_per_token / 1e6,
                            self.ns_per_attention_pair / 1e9, self.us_per_kv_token / 1e6,
                            self.us_per_seq / 1e6)  # fmt: skip
        f = self.token_scale
        return StepCosts(raw.floor / f, raw.per_token / f, raw.per_pair / f**2,
                         raw.per_kv_token / f, raw.per_seq / f)  # fmt: skip

    def num_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9) -> int:
        """KV blocks the modelled GPU holds (the profile's memory, else an H100 with an
        8B model), times ``token_scale``."""
        if self.profile is None:
            full = default_num_blocks(block_size, gpu_memory_utilization)
        else:
            full = PROFILES[self.profile].kv_tokens(gpu_memory_utilization) // block_size
        return max(1, int(full * self.token_scale))

    def step_seconds(self, batch: ScheduledBatch) -> float:
        c = self._costs
        tokens = 0
        kv = 0
        pairs = 0.0
        for seq in batch.seqs:
            n = len(seq.token_ids)
            tokens += n
            kv += seq.start_pos + n
            pairs += n * (seq.start_pos + (n + 1) / 2)  # causal: query i sees start_pos + i
        compute = tokens * c.per_token + pairs * c.per_pair
        return max(c.floor, compute) + kv * c.per_kv_token + len(batch.seqs) * c.per_seq


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
        self._floor_s = self.timing.costs().floor
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
        back_to_back = self._deadline is not None and now - self._deadline < self._floor_s
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
