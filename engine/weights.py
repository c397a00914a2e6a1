"""Build a model from a local Hugging Face directory: dtype, device, safetensors, GGUF or dummy.

The model is constructed on the meta device (no allocation, no random init), then
materialized directly on the target device in the target dtype and filled from the
checkpoint — so a large model never exists twice in memory.
"""

from __future__ import annotations

import ctypes
import json
import logging
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .models import LlamaForCausalLM, ModelConfig, model_class

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
#: ``--quantization``: auto (gguf for a GGUF served on CPU, else none); gguf (keep a
#: GGUF's quantized weights packed, models/quantized.py); none (dequantize to --dtype).
QUANTIZATIONS = ("auto", "gguf", "none")
#: ``--kv-cache-dtype``: vLLM's ``auto`` and ``bfloat16``, and ``float32`` (not vLLM's: the
#: way back to a float32 cache on CPU, where ``auto`` stores a float32 model's KV in bfloat16).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """ "auto": the checkpoint's dtype on CUDA; float32 on CPU (fast and exact there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        name = (cfg.torch_dtype or "bfloat16").removeprefix("torch.")
        resolved = _DTYPES.get(name, torch.bfloat16)
        # fp32 checkpoints serve in bf16 on GPU (fp16's range overflows more easily).
        return torch.bfloat16 if resolved == torch.float32 else resolved
    try:
        return _DTYPES[dtype.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (choose auto, {', '.join(_DTYPES)})") from None


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype (``--kv-cache-dtype``): "auto" is the model's dtype, except
    a float32 model on CPU keeps bfloat16 KV: half the bytes for the same tokens, at no
    step-time cost (attention reads the cache back in float32; figures in
    docs/benchmarks/engine.md)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype}: choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if kv_cache_dtype == "auto":
        return torch.bfloat16 if device.type == "cpu" and dtype == torch.float32 else dtype
    return _DTYPES[kv_cache_dtype]


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing). Loading frees ~115 MiB of transients (a GGUF's dequantized and packed
    copies) that glibc otherwise keeps resident in the heap for the server's lifetime."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: those the sharding index names, else every *.safetensors."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that do not exist: {absent}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d} (use --load-format dummy?)")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _gguf_weights(model_dir: str | Path) -> Path | None:
    """The directory's GGUF (gguf_model.prepare_model_dir links one in) when it has no
    safetensors."""
    d = Path(model_dir)
    if any(d.glob("*.safetensors")):
        return None
    return next(iter(sorted(d.glob("*.gguf"))), None)


def _gguf_path(model_dir: str | Path) -> Path:
    path = _gguf_weights(model_dir)
    if path is None:
        raise FileNotFoundError(f"no *.gguf weights in {model_dir}")
    return path


def resolve_quantization(quantization: str, gguf: bool, device: torch.device) -> bool:
    """Whether to keep a GGUF's quantized weights packed (``--quantization``).

    The packed kernel is torch's CPU one, so "auto" packs a GGUF served on CPU (a
    decode step reads ~5x fewer bytes, docs/benchmarks/engine.md) and dequantizes
    otherwise; "gguf" where it cannot apply is an error, not a silent fallback.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r} (choose {', '.join(QUANTIZATIONS)})"
        )
    if quantization == "none":
        return False
    if quantization == "gguf" and not gguf:
        raise ValueError("--quantization gguf needs a GGUF checkpoint")
    if quantization == "gguf" and device.type != "cpu":
        raise ValueError(
            "--quantization gguf runs on CPU only (torch's CPU int4 kernel); on "
            f"{device.type} use --quantization none"
        )
    return gguf and device.type == "cpu"


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class _SkipInit(TorchFunctionMode):
    """Skips ``torch.nn.init`` while a model is built on the meta device.

    A meta tensor holds no values, so initializing one does nothing useful, and
    ``normal_`` on meta (``nn.Embedding``'s init) runs torch's Python reference, which
    imports ``torch._dynamo``: triton, sympy and inductor's config, 144 MiB of resident
    memory in an engine that never compiles (measured on SmolLM2).
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str = "auto",
) -> LlamaForCausalLM:
    """Instantiate the registered class for `cfg` and fill its weights."""
    from .gguf_model import iter_gguf_weights, tensor_types

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r} (choose {', '.join(LOAD_FORMATS)})")
    gguf = load_format == "gguf" or (load_format == "auto" and _gguf_weights(model_dir) is not None)
    packed = resolve_quantization(quantization, gguf, device)
    cls = model_class(cfg)
    with torch.device("meta"), _default_dtype(dtype), _SkipInit():
        model = cls(cfg)
        if packed:
            dense = model.quantize_modules(tensor_types(_gguf_path(model_dir)))
            for module, why in sorted(dense.items()):
                log.info("%s stays dense: %s", module, why)
    # `to_empty`, but with torch.empty: empty_like of a meta tensor runs torch's Python
    # reference, which imports sympy (34 MiB resident) for its stride logic.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    dense_head = isinstance(model.lm_head, torch.nn.Linear)
    if cfg.tie_word_embeddings and dense_head:  # _apply materializes the shared tensor twice
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        if load_format == "dummy":
            _dummy_init(model, seed)
        elif gguf:
            path = _gguf_path(model_dir)
            model.load_weights(iter_gguf_weights(path, cfg, keep_quantized=packed))
        else:
            model.load_weights(iter_safetensors(model_dir))
    model.prepare_buffers(device)
    release_freed_memory()
    return model.eval().requires_grad_(False)


def _dummy_init(model: torch.nn.Module, seed: int) -> None:
    """Random weights for benchmarking without a checkpoint (like vLLM's dummy format):
    norms at 1, everything else small uniform noise, seeded so runs are comparable."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:  # drawn on the parameter's device: a GPU fills billions of values in ms
            gen = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
            p.uniform_(-0.1, 0.1, generator=gen)
