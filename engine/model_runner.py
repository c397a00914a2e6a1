"""The real model runner: packs a scheduled step, runs the model over the paged KV cache,
and samples. Implements `infergate.engine.interfaces.ModelRunner`.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from .attention import (
    AttentionBackend,
    AttentionContext,
    build_metadata,
    get_backend,
    kv_cache_shape,
)
from .interfaces import ScheduledBatch, ScheduledSeq, TokenLogprob
from .lora.runner import TorchLoRA
from .models import LlamaForCausalLM, ModelConfig
from .sampler import Sampler
from .structured_output.matcher import apply_grammar_bitmask
from .weights import load_model, resolve_device, resolve_dtype, resolve_kv_cache_dtype

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 128 * 1024**2  # CPU budget when neither blocks nor bytes are given
CPU_MAX_FULL_SEQS = 32  # ... but never more than this many max-length sequences' worth


class TorchModelRunner:
    """Runs Llama/Qwen3 models in torch over a paged KV cache, one tensor per layer."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        *,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_batched_tokens: int = 2048,
        backend: AttentionBackend | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids: tuple[int, ...] = config.eos_token_ids
        self.vocab_size = config.vocab_size
        self.backend = backend or get_backend("torch")
        self.kv_cache_dtype = kv_cache_dtype or dtype  # the attention backend reads it back
        shape = kv_cache_shape(num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=device)
            for _ in range(config.num_layers)
        ]
        self.sampler = Sampler(device)
        self._logprobs: dict[str, TokenLogprob] = {}
        self._prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = {}
        self.lora: TorchLoRA | None = None  # set by lora.runner.attach_torch_lora
        self.cpu_threads: int | None = None  # torch threads for the steps (CPU only)
        self._threads_on: int | None = None  # the thread they were applied on

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        cpu_threads: int | None = None,
        quantization: str = "auto",
        kv_cache_dtype: str = "auto",
        kv_cache_memory_bytes: int | None = None,
    ) -> TorchModelRunner:
        """Load `model_dir` (config.json + safetensors, or dummy weights) and size the cache.

        On CPU this also picks torch's intra-op threads for the steps (`cpu_threads`,
        else ``OMP_NUM_THREADS`` when set, else one per 512 of hidden size): a small
        model's ops are too short to amortize a thread team, and on a shared machine
        idle-waiting threads cost 10x; the quantized matmuls do split well, so a
        deployment that gives the engine cores says so with ``OMP_NUM_THREADS``. The
        model loads on one thread, and the team is made by the thread that runs the
        steps (see `_own_threads`).

        The KV cache takes `kv_cache_dtype` (`weights.resolve_kv_cache_dtype`) and, unless
        `num_blocks` is given, `kv_cache_memory_bytes` (default: `_auto_num_blocks`).
        """
        cfg = ModelConfig.from_model_dir(model_dir)
        dev = resolve_device(device)
        threads = None
        if dev.type == "cpu":
            env = os.environ.get("OMP_NUM_THREADS", "")
            wanted = cpu_threads or (int(env) if env.isdigit() else 0)
            wanted = wanted or max(1, cfg.hidden_size // 512)
            threads = max(1, min(wanted, os.cpu_count() or 1))
            torch.set_num_threads(1)
        dt = resolve_dtype(dtype, cfg, dev)
        kv_dt = resolve_kv_cache_dtype(kv_cache_dtype, dt, dev)
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {kv_cache_memory_bytes}")
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        elif max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        elif max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
        model = load_model(
            model_dir,
            cfg,
            dtype=dt,
            device=dev,
            load_format=load_format,
            seed=seed,
            quantization=quantization,
        )
        if num_blocks is None:
            num_blocks = _auto_num_blocks(
                cfg,
                block_size,
                dt,
                dev,
                max_model_len,
                gpu_memory_utilization,
                max_num_batched_tokens,
                kv_dt,
                kv_cache_memory_bytes,
            )
        log.info(
            "loaded %s on %s (%s): %d KV blocks of %d tokens (%s, %.0f MiB)",
            cfg.architecture,
            dev,
            dt,
            num_blocks,
            block_size,
            kv_dt,
            num_blocks * kv_block_bytes(cfg, block_size, kv_dt) / 2**20,
        )
        runner = cls(
            model,
            cfg,
            block_size=block_size,
            num_blocks=num_blocks,
            device=dev,
            dtype=dt,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_dtype=kv_dt,
        )
        runner.cpu_threads = threads
        return runner

    def _own_threads(self) -> None:
        """Give the thread that runs the steps its team of `cpu_threads` (once per thread).

        OpenMP (libgomp) keeps one team per thread that starts parallel work. When the
        teams' threads together outnumber the cores, every team stops spinning between
        parallel regions and sleeps on a futex instead, and a decode step (~300 short
        regions) ran 2x slower: the server loads on its main thread and steps on the
        engine thread. So the model loads single-threaded (no team), and the stepping
        thread makes the only team.
        """
        ident = threading.get_ident()
        if self.cpu_threads is not None and self._threads_on != ident:
            torch.set_num_threads(self.cpu_threads)
            self._threads_on = ident

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Compute every scheduled token's KV; sample where `sample` is set."""
        logits = self.compute_logits(batch)
        sampled = [s for s in batch.seqs if s.sample]
        if not sampled:
            return [None] * len(batch.seqs)
        params = [s.sampling for s in sampled]
        # Penalties, bias and min_tokens first, so logprobs see what sampling saw.
        logits = self.sampler.process(
            logits,
            params,
            [s.prompt_token_ids for s in sampled],
            [s.output_token_ids for s in sampled],
            [s.blocked_token_ids for s in sampled],
        )
        # The grammar's bitmask restricts what is sampled; logprobs stay those of the
        # distribution before it (a masked token's logprob would be -inf).
        allowed = apply_grammar_bitmask(logits, [s.grammar for s in sampled])
        chosen = self.sampler.sample(
            allowed, params, [s.request_id for s in sampled], [s.num_generated for s in sampled]
        )
        self._record_logprobs(logits, sampled, chosen)
        tokens = iter(chosen)
        return [next(tokens) if s.sample else None for s in batch.seqs]

    def _record_logprobs(
        self, logits: torch.Tensor, sampled: list[ScheduledSeq], chosen: list[int]
    ) -> None:
        """Logprobs of the sampled tokens, for the rows that asked (one batched call)."""
        rows = [i for i, s in enumerate(sampled) if s.sampling.logprobs is not None]
        if not rows:
            return
        top_n = max(sampled[i].sampling.logprobs or 0 for i in rows)
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        entries = self.sampler.logprobs(
            logits[index],
            [sampled[i].sampling.temperature for i in rows],
            [chosen[i] for i in rows],
            top_n,
        )
        for i, entry in zip(rows, entries, strict=True):
            n = sampled[i].sampling.logprobs or 0
            self._logprobs[sampled[i].request_id] = (
                entry if len(entry.top) == n else TokenLogprob(
                    entry.token_id, entry.logprob, entry.rank, entry.top[:n])
            )  # fmt: skip

    def take_logprobs(
        self,
    ) -> tuple[dict[str, TokenLogprob], dict[str, tuple[int, list[TokenLogprob]]]]:
        """The last step's (sampled-token logprobs, (first position, prompt logprobs)) per
        request id, for requests that asked; clears them. Optional for a runner: the core
        looks it up by name, and the simulator, with no logits, has none."""
        out = (self._logprobs, self._prompt_logprobs)
        self._logprobs, self._prompt_logprobs = {}, {}
        return out

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the forward pass; logits [num sampled seqs, vocab] of each sampled seq's
        last token (float32), in batch order."""
        self._own_threads()
        self._validate(batch)
        self._copy_blocks(batch.block_copies)
        seqs = [s for s in batch.seqs if s.token_ids]
        if not seqs:
            return torch.empty(0, self.vocab_size, device=self.device)
        meta = build_metadata(
            query_lens=[len(s.token_ids) for s in seqs],
            context_lens=[s.start_pos for s in seqs],
            block_tables=[s.block_table for s in seqs],
            block_size=self.block_size,
            device=self.device,
        )
        self.backend.prepare(meta)
        if self.lora is not None:
            self.lora.prepare(seqs)
        elif any(s.lora_name for s in seqs):
            raise ValueError("a sequence asks for a LoRA adapter but LoRA is not enabled")
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
        hidden = self.model(
            ids.to(self.device, non_blocking=True),
            meta.positions,
            AttentionContext(self.backend, meta, self.kv_caches),
        )
        last_rows, end = [], 0
        for s in seqs:
            end += len(s.token_ids)
            if s.sample:
                last_rows.append(end - 1)
            if s.sampling.prompt_logprobs is not None:
                self._chunk_prompt_logprobs(s, hidden[end - len(s.token_ids) : end])
        if not last_rows:
            return torch.empty(0, self.vocab_size, device=self.device)
        rows = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked block tables: each destination block gets the source's
        keys and values in every layer (one indexed copy per layer)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for cache in self.kv_caches:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def _chunk_prompt_logprobs(self, seq: ScheduledSeq, hidden: torch.Tensor) -> None:
        """Raw logprobs of the prompt tokens that this chunk's positions predict."""
        targets = seq.token_ids[1:] + seq.next_prompt_ids
        # Position start_pos + i scores token start_pos + i + 1, prompt tokens only (a
        # recompute after preemption also covers generated tokens).
        count = min(len(targets), max(0, seq.num_prompt_tokens - 1 - seq.start_pos))
        if count <= 0:
            return
        logits = self.model.compute_logits(hidden[:count]).float()
        entries = self.sampler.logprobs(
            logits, [1.0] * count, targets[:count], seq.sampling.prompt_logprobs or 0
        )
        self._prompt_logprobs[seq.request_id] = (seq.start_pos + 1, entries)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def _validate(self, batch: ScheduledBatch) -> None:
        for s in batch.seqs:
            end = s.start_pos + len(s.token_ids)
            if s.start_pos < 0 or end > self.max_model_len:
                raise ValueError(
                    f"{s.request_id}: positions [{s.start_pos}, {end}) outside max_model_len "
                    f"{self.max_model_len}"
                )
            if s.sample and not s.token_ids:
                raise ValueError(f"{s.request_id}: sample=True needs at least one token")
            needed = -(-end // self.block_size)
            if len(s.block_table) < needed:
                raise ValueError(
                    f"{s.request_id}: block_table has {len(s.block_table)} blocks, "
                    f"{needed} needed for {end} tokens"
                )
            bad = [b for b in s.block_table[:needed] if not 0 <= b < self.num_blocks]
            if bad:
                raise ValueError(f"{s.request_id}: block ids out of range: {bad[:5]}")
            bad_tok = [t for t in s.token_ids if not 0 <= t < self.vocab_size]
            if bad_tok:
                raise ValueError(f"{s.request_id}: token ids out of vocabulary: {bad_tok[:5]}")


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def _auto_num_blocks(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    kv_dtype: torch.dtype | None = None,
    memory_bytes: int | None = None,
) -> int:
    """KV capacity in blocks of `kv_dtype` (default `dtype`): `memory_bytes` when given
    (vLLM's ``--kv-cache-memory-bytes``, on any device); else on CPU a fixed budget, at
    least one max_model_len sequence and at most CPU_MAX_FULL_SEQS of them; on CUDA, what
    the utilization target leaves after weights and a reserve for activations."""
    per_block = kv_block_bytes(cfg, block_size, kv_dtype or dtype)
    blocks_per_seq = -(-max_model_len // block_size)
    if memory_bytes is not None:
        if memory_bytes < per_block * blocks_per_seq:
            raise ValueError(
                f"--kv-cache-memory-bytes {memory_bytes} holds {memory_bytes // per_block} "
                f"blocks, fewer than one {max_model_len}-token sequence's {blocks_per_seq} "
                f"({per_block * blocks_per_seq} bytes); raise it or lower max_model_len"
            )
        return memory_bytes // per_block
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        itemsize = torch.empty((), dtype=dtype).element_size()
        activations = (
            max_num_batched_tokens
            * (8 * cfg.hidden_size + 2 * cfg.intermediate_size + 2 * cfg.vocab_size)
            * max(itemsize, 4)
        )
        budget = int(total * gpu_memory_utilization) - used - activations
        if budget < per_block * blocks_per_seq:
            raise ValueError(
                f"not enough GPU memory for one {max_model_len}-token sequence's KV cache "
                f"(budget {budget / 2**20:.0f} MiB); lower max_model_len or raise "
                "gpu_memory_utilization"
            )
        return budget // per_block
    return max(
        blocks_per_seq, min(CPU_KV_CACHE_BYTES // per_block, CPU_MAX_FULL_SEQS * blocks_per_seq)
    )
