"""The CPU decode step's glue kernels (decode_cpu.c), built at first use and called
through ctypes.

Why C: at batch 1 a SmolLM2 step on 2 cores spent ~7 of its ~15 ms outside the
quantized matmuls, in ~40 small torch ops a layer (each a dispatch and an allocation),
and torch.compile took minutes per shape on this machine. Each kernel here replaces
5–20 of those ops with one loop over the same layouts; see the C file for the math.

The library is compiled with the system's C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/infergate/kernels`` (keyed by the source, flags and CPU), once per
machine. Without a compiler, or with ``INFERGATE_CPU_KERNELS=0``, `load` returns None
and the model runs its torch ops, with a log line that says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "rms_norm_bf16": [_P, _P, _P, _I, _I, _F],
    "add_rms_norm_bf16": [_P, _P, _P, _P, _I, _I, _F],
    "silu_mul_bf16": [_P, _I, _P, _I, _I],
    "rope_store": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, ctypes.c_int],
    "decode_attention": [_P, _P, ctypes.c_int, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P],
    "q8_0_matmul": [_P, _I, _I, _P, _I, _P],
}
_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infergate" / "kernels"


def _cpu() -> str:
    """This CPU's instruction sets (``-march=native`` builds for them): part of the cache
    key, so a home directory shared by other machines never loads a foreign build."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    """The shared library for this source, these flags and this CPU, compiled if not
    cached (into a temporary name, then renamed: concurrent builds cannot see half a
    file)."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS, _cpu()]).encode())
    target = _cache_dir() / f"decode_cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
            check=True, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> DecodeKernels | None:
    """The kernels, or None (logged once) where they cannot be built here."""
    if os.environ.get("INFERGATE_CPU_KERNELS", "1") == "0":
        log.info("CPU decode kernels off (INFERGATE_CPU_KERNELS=0): torch ops instead")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (set CC or install gcc): CPU decode steps use torch ops")
        return None
    try:
        return DecodeKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("CPU decode kernels not built (%s): torch ops instead", detail)
        return None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: need a contiguous CPU {dtype} tensor, got {t.dtype} {t.device}")


def _check_cache(cache: torch.Tensor, step: DecodeStep, kv_heads: int, dim: int) -> None:
    """`cache` is a layer's KV cache of the shape the step's indices were checked
    against ([num_blocks, 2, block_size, kv_heads, dim]), in a dtype the kernels read."""
    want = (step.num_blocks, 2, step.block_size, kv_heads, dim)
    if tuple(cache.shape) != want or cache.dtype not in _CACHE_DTYPES:
        raise ValueError(
            f"KV cache {tuple(cache.shape)} {cache.dtype}: need {want}, float32 or bfloat16"
        )
    _check(cache, cache.dtype, "KV cache")


class DecodeKernels:
    """Typed wrappers: each checks dtypes, contiguity and shapes, allocates the output,
    and calls one C function. Indices (positions, slots, block tables, lengths) are
    checked once per step (`DecodeStep`), not once per layer; each layer's cache is
    checked against that step's geometry (`_check_cache`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int if name in ("rope_store", "decode_attention") else None
        self._lib = lib

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """bf16(rms_norm(x) * weight) of float32 rows x [T, n]."""
        _check(x, torch.float32, "x")
        _check(weight, torch.float32, "weight")
        rows, n = x.shape
        assert weight.numel() == n
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        self._lib.rms_norm_bf16(_ptr(x), _ptr(weight), _ptr(out), rows, n, eps)
        return out

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """h += delta (bf16, in place), then bf16(rms_norm(h) * weight)."""
        _check(h, torch.float32, "h")
        _check(delta, torch.bfloat16, "delta")
        _check(weight, torch.float32, "weight")
        rows, n = h.shape
        assert delta.shape == h.shape and weight.numel() == n
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        self._lib.add_rms_norm_bf16(_ptr(h), _ptr(delta), _ptr(weight), _ptr(out), rows, n, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """bf16(silu(gate) * up) of bf16 rows gate|up [T, >= 2 * inter]."""
        _check(gate_up, torch.bfloat16, "gate_up")
        rows, width = gate_up.shape
        assert width >= 2 * inter
        out = torch.empty(rows, inter, dtype=torch.bfloat16)
        self._lib.silu_mul_bf16(_ptr(gate_up), width, _ptr(out), rows, inter)
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        step: DecodeStep,
        cache: torch.Tensor,
        heads: int,
        kv_heads: int,
        dim: int,
    ) -> torch.Tensor:
        """Rotated queries (float32 [T, heads, dim]) of bf16 q|k|v rows; each token's
        rotated key and its value written to its slot in `cache`."""
        _check(qkv, torch.bfloat16, "qkv")
        _check_cache(cache, step, kv_heads, dim)
        tokens, width = qkv.shape
        assert width >= (heads + 2 * kv_heads) * dim and tokens == step.tokens
        assert step.table.shape[1] == dim, "rotary table rows are one head's cos ‖ sin"
        q = torch.empty(tokens, heads, dim, dtype=torch.float32)
        status = self._lib.rope_store(
            _ptr(qkv), width, _ptr(step.table), _ptr(step.positions), _ptr(step.slots),
            tokens, heads, kv_heads, dim, step.block_size, _ptr(q), _ptr(cache),
            _CACHE_DTYPES[cache.dtype],
        )  # fmt: skip
        if status != 0:
            raise MemoryError("rope_store: out of memory")
        return q

    def attention(
        self, q: torch.Tensor, cache: torch.Tensor, step: DecodeStep, kv_heads: int, scale: float
    ) -> torch.Tensor:
        """softmax(q·Kᵀ·scale)·V of one query per sequence over its cached tokens, as
        bf16 [S, heads * dim]."""
        _check(q, torch.float32, "q")
        seqs, heads, dim = q.shape
        _check_cache(cache, step, kv_heads, dim)
        assert seqs == step.tokens and heads % kv_heads == 0
        out = torch.empty(seqs, heads * dim, dtype=torch.bfloat16)
        status = self._lib.decode_attention(
            _ptr(q), _ptr(cache), _CACHE_DTYPES[cache.dtype], _ptr(step.tables),
            step.tables.shape[1], _ptr(step.seq_lens), seqs, heads, kv_heads, dim,
            step.block_size, scale, _ptr(out),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("decode_attention: out of memory")
        return out


    def q8_0_matmul(self, blocks: torch.Tensor, cols: int, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ in float32 [M, rows] for float32 rows x [M, cols] and W as GGUF Q8_0
        blocks (uint8 [rows, cols / 32 * 34]): the dequantized weights' exact dot products."""
        _check(blocks, torch.uint8, "Q8_0 blocks")
        _check(x, torch.float32, "x")
        rows = blocks.shape[0]
        if cols % 32 or blocks.dim() != 2 or blocks.shape[1] != cols // 32 * 34:
            raise ValueError(f"Q8_0 blocks {tuple(blocks.shape)} do not hold {cols} columns")
        if x.dim() != 2 or x.shape[1] != cols:
            raise ValueError(f"x {tuple(x.shape)}: need [M, {cols}]")
        y = torch.empty(x.shape[0], rows, dtype=torch.float32)
        self._lib.q8_0_matmul(_ptr(blocks), rows, cols, _ptr(x), x.shape[0], _ptr(y))
        return y


class DecodeStep:
    """One decode step's indices, checked once against the cache and the rotary table
    so that the kernels, which index memory with them, stay in bounds."""

    def __init__(
        self,
        *,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        table: torch.Tensor,
        block_size: int,
        num_blocks: int,
    ) -> None:
        self.positions = positions.to(torch.int64).contiguous()
        self.slots = slots.to(torch.int64).contiguous()
        self.tables = tables.to(torch.int32).contiguous()
        self.seq_lens = seq_lens.to(torch.int32).contiguous()
        self.table = table
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tokens = self.positions.numel()
        _check(table, torch.float32, "rotary table")
        if not (self.slots.numel() == self.seq_lens.numel() == self.tables.shape[0] == self.tokens):
            raise ValueError("a decode step has one token, slot, table and length per sequence")
        width = self.tables.shape[1] * block_size
        if self.tokens and (
            int(self.positions.min()) < 0 or int(self.positions.max()) >= table.shape[0]
            or int(self.slots.min()) < 0 or int(self.slots.max()) >= num_blocks * block_size
            or int(self.tables.min()) < 0 or int(self.tables.max()) >= num_blocks
            or int(self.seq_lens.min()) < 1 or int(self.seq_lens.max()) > width
        ):  # fmt: skip
            raise ValueError("decode step indices out of the cache's or the table's range")


class Geometry(NamedTuple):
    """A decoder layer's sizes, the same for every layer of the models this path takes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int


class StepKernels:
    """The kernels for every layer of one decode step, checked once per step.

    `DecodeKernels` checks each call's tensors and allocates its output: ~4 µs of Python
    per call, ~150 calls a step (~0.6 ms of a ~10 ms SmolLM2 step on 2 cores). Here the
    outputs are allocated once per step and reused by every layer (each is consumed by
    the next matmul before the next layer writes it), every layer's cache is checked
    once, and a call checks only the matmul output it is given (`_rows`).
    """

    def __init__(
        self,
        kernels: DecodeKernels,
        step: DecodeStep,
        caches: list[torch.Tensor],
        g: Geometry,
        h: torch.Tensor,
    ) -> None:
        """`h`: the step's residual stream (float32 [tokens, hidden]), updated in place."""
        for cache in caches:
            _check_cache(cache, step, g.kv_heads, g.head_dim)
        _check(h, torch.float32, "hidden states")
        if tuple(h.shape) != (step.tokens, g.hidden) or step.table.shape[1] != g.head_dim:
            raise ValueError("hidden states or rotary table do not match the step's geometry")
        self._lib, self._step, self._g, self._h = kernels._lib, step, g, h
        self._caches = [(_ptr(c), _CACHE_DTYPES[c.dtype]) for c in caches]
        t = step.tokens
        self.normed = torch.empty(t, g.hidden, dtype=torch.bfloat16)
        self.q = torch.empty(t, g.heads, g.head_dim, dtype=torch.float32)
        self.attended = torch.empty(t, g.heads * g.head_dim, dtype=torch.bfloat16)
        self.act = torch.empty(t, g.inter, dtype=torch.bfloat16)
        self._p = {n: _ptr(getattr(self, n)) for n in ("normed", "q", "attended", "act")}

    def _rows(self, t: torch.Tensor, width: int, name: str) -> int:
        """`t`'s pointer once it is bf16 rows [tokens, >= width], contiguous."""
        if (
            t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[0] != self._step.tokens
            or t.shape[1] < width or not t.is_contiguous()
        ):  # fmt: skip
            raise ValueError(f"{name}: need contiguous bf16 [{self._step.tokens}, >= {width}]")
        return _ptr(t)

    def add_rms_norm(self, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h += delta; bf16(rms_norm(h) * weight) in `normed`. `weight`: float32 [hidden]
        (the plan checks each layer's once)."""
        hidden, h = self._g.hidden, self._h
        if delta.shape[-1] != hidden:
            raise ValueError(f"residual delta of width {delta.shape[-1]}, need {hidden}")
        d = self._rows(delta, hidden, "residual delta")
        self._lib.add_rms_norm_bf16(
            _ptr(h), d, _ptr(weight), self._p["normed"], h.shape[0], hidden, eps
        )
        return self.normed

    def rope_attention(self, qkv: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """Rotary and the cache store, then attention: bf16 [tokens, heads * dim]."""
        g, s = self._g, self._step
        width = (g.heads + 2 * g.kv_heads) * g.head_dim
        ptr, stride = self._rows(qkv, width, "q|k|v"), qkv.shape[1]
        cache, bf16 = self._caches[layer]
        if self._lib.rope_store(
            ptr, stride, _ptr(s.table), _ptr(s.positions), _ptr(s.slots), s.tokens, g.heads,
            g.kv_heads, g.head_dim, s.block_size, self._p["q"], cache, bf16,
        ) or self._lib.decode_attention(
            self._p["q"], cache, bf16, _ptr(s.tables), s.tables.shape[1], _ptr(s.seq_lens),
            s.tokens, g.heads, g.kv_heads, g.head_dim, s.block_size, scale,
            self._p["attended"],
        ):  # fmt: skip
            raise MemoryError("decode attention: out of memory")
        return self.attended

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """bf16(silu(gate) * up) of gate|up rows, in `act`."""
        inter = self._g.inter
        ptr = self._rows(gate_up, 2 * inter, "gate|up")
        self._lib.silu_mul_bf16(ptr, gate_up.shape[1], self._p["act"], self._step.tokens, inter)
        return self.act
