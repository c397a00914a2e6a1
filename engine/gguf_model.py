"""Serve a GGUF file (llama.cpp's format), as ``vllm serve ./model.gguf`` does.

A GGUF holds weights (often quantized), the model's hyperparameters and its tokenizer in
one file. The engine's loaders read a Hugging Face directory, so :func:`prepare_model_dir`
derives one next to the cache: ``config.json`` and ``tokenizer.json`` /
``tokenizer_config.json`` from the GGUF metadata, plus a link to the GGUF, whose tensors
:func:`iter_gguf_weights` reads at load (F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0, Q4_1)
under Hugging Face names: dequantized to float32, or, for ``--quantization gguf``, the
quantized blocks as they are (models/quantized.py multiplies them without dequantizing).
Only the small derived files are written; the weights stay in the GGUF.

The file is read with the ``gguf`` package (llama.cpp's own reader and dequantizers).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .models.quantized import PACKABLE, QuantizedTensor

FORMAT_VERSION = 1  # bump when the derived files change, so old ones are not reused

ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# llama.cpp tensor name (after "blk.N.") → Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# How each `tokenizer.ggml.pre` splits text before BPE (as llama.cpp's vocabulary code does).
_GPT2_PRE = "gpt2"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")


class GGUFError(ValueError):
    """The GGUF file cannot be served; the message names the problem."""


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading GGUF files needs the 'gguf' package: pip install gguf") from None
    return gguf


def find_gguf(path: Path) -> Path | None:
    """`path` if it is a .gguf file; the one .gguf in a directory that is not a Hugging Face
    model directory (no config.json); else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise GGUFError(f"{path} holds several GGUF files ({names}); name the one to serve")
    return found[0] if found else None


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over `path`, with a clear error for what is not a whole GGUF."""
    gguf = _gguf()
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as error:
        if "GGMLQuantizationType" in str(error):
            raise GGUFError(
                f"{path} has a tensor of an unknown quantization type ({error}); it is "
                "newer than the gguf package, or corrupt"
            ) from None
        raise GGUFError(
            f"{path} is truncated or corrupt ({path.stat().st_size} bytes; reading it "
            f"failed: {error})"
        ) from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise GGUFError(f"{path} is truncated: its tensors need {end} bytes")
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture(reader: Any) -> str:
    arch = _field(reader, _gguf().Keys.General.ARCHITECTURE)
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return str(arch)


def hf_config(reader: Any) -> dict[str, Any]:
    """The Hugging Face ``config.json`` equivalent of the GGUF's ``{arch}.*`` metadata."""
    keys = _gguf().Keys
    arch = architecture(reader)

    def get(template: str, default: Any = None) -> Any:
        return _field(reader, template.format(arch=arch), default)

    names = {t.name for t in reader.tensors}
    heads = get(keys.Attention.HEAD_COUNT)
    hidden = get(keys.LLM.EMBEDDING_LENGTH)
    if heads is None or hidden is None:
        raise GGUFError(f"GGUF metadata lacks {arch}.attention.head_count or embedding_length")
    head_dim = int(get(keys.Attention.KEY_LENGTH) or hidden // heads)
    rotary = get(keys.Rope.DIMENSION_COUNT)
    if rotary is not None and int(rotary) != head_dim:
        raise GGUFError(f"partial rotary embeddings ({rotary} of {head_dim}) are not supported")
    if "rope_freqs.weight" in names:
        raise GGUFError("per-frequency rope factors (rope_freqs.weight) are not supported")
    scaling = get(keys.Rope.SCALING_TYPE)
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get(keys.Rope.SCALING_FACTOR))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"rope scaling {scaling!r} is not supported (only linear)")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    tokens = _field(reader, keys.Tokenizer.LIST) or []
    vocab = get(keys.LLM.VOCAB_SIZE) or (int(embd.shape[1]) if embd is not None else len(tokens))
    # llama.cpp ends generation at any end-of-generation token: EOS, end of turn, end of message.
    stops = (keys.Tokenizer.EOS_ID, keys.Tokenizer.EOT_ID, keys.Tokenizer.EOM_ID)
    eos = list(dict.fromkeys(i for k in stops if (i := _field(reader, k)) is not None))
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(get(keys.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(get(keys.LLM.BLOCK_COUNT)),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(get(keys.Attention.HEAD_COUNT_KV) or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(get(keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        "rope_theta": float(get(keys.Rope.FREQ_BASE, 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(get(keys.LLM.CONTEXT_LENGTH, 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, keys.Tokenizer.BOS_ID),
        "eos_token_id": eos,
    }


def check_tensor_types(reader: Any) -> None:
    """Refuse, before loading anything, a tensor stored in a type we do not dequantize."""
    q = _gguf().GGMLQuantizationType
    supported = {q.F32, q.F16, q.BF16, q.Q8_0, q.Q5_0, q.Q5_1, q.Q4_0, q.Q4_1}
    for t in reader.tensors:
        if t.tensor_type not in supported:
            names = ", ".join(sorted(s.name for s in supported))
            raise GGUFError(
                f"tensor {t.name} is quantized as {t.tensor_type.name}, which is not "
                f"supported (supported: {names})"
            )


def iter_gguf_weights(
    path: Path, cfg: Any, *, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Every tensor of the GGUF under its Hugging Face name: dequantized to float32, or,
    with `keep_quantized`, the matrices of a type models/quantized.py packs as their
    stored blocks (a :class:`QuantizedTensor`).

    llama.cpp stores Q and K rows permuted (each head's rotary pairs interleaved, for its
    rope kernel); they are put back in Hugging Face's half-split order here (whole rows,
    so blocks move as they are). `cfg` is the engine's ModelConfig (head counts for that).
    """
    gguf = _gguf()
    reader = open_gguf(path)
    check_tensor_types(reader)
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))
        tensor: Any
        if keep_quantized and t.tensor_type.name in PACKABLE and len(shape) == 2:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            tensor = QuantizedTensor(t.tensor_type.name, raw, (shape[0], shape[1]))
        else:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            tensor = torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(shape)
        if isinstance(tensor, QuantizedTensor) and ".q_proj." in name:
            tensor = _unpermute_rows(tensor, cfg.num_heads)
        elif isinstance(tensor, QuantizedTensor) and ".k_proj." in name:
            tensor = _unpermute_rows(tensor, cfg.num_kv_heads)
        elif ".q_proj." in name:
            tensor = _unpermute(tensor, cfg.num_heads)
        elif ".k_proj." in name:
            tensor = _unpermute(tensor, cfg.num_kv_heads)
        yield name, tensor


def hf_tensor_name(name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; names that do
    not map come back unchanged (so the loader reports them as unknown)."""
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    return name


def tensor_types(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Hugging Face name → (GGUF type name, shape rows-first) of every tensor, read from
    the header only (to choose which modules stay quantized before loading)."""
    reader = open_gguf(path)
    return {
        hf_tensor_name(t.name): (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))
        for t in reader.tensors
    }


def _unpermute_rows(t: QuantizedTensor, n_heads: int) -> QuantizedTensor:
    """:func:`_unpermute` of a quantized Q/K weight: its rows of blocks move whole."""
    return QuantizedTensor(t.qtype, _unpermute(t.raw, n_heads).contiguous(), t.shape)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of a Q/K weight (or bias): within each head, rows
    stored as (pair, 2) go back to (2, pair)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def build_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers`` tokenizer and a ``tokenizer_config.json`` from the GGUF's vocabulary.

    Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are built; for
    others (SentencePiece) serve with ``--tokenizer DIR``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    keys = _gguf().Keys.Tokenizer
    kind = _field(reader, keys.MODEL)
    if kind != "gpt2":
        raise GGUFError(
            f"the GGUF's tokenizer is {kind!r}; only byte-level BPE ('gpt2') is converted "
            "(pass --tokenizer DIR with a tokenizer.json)"
        )
    tokens: list[str] = list(_field(reader, keys.LIST) or [])
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, keys.MERGES) or []]
    if not tokens or not merges:
        raise GGUFError("the GGUF has no tokenizer vocabulary or merges")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, keys.PRE) or "default")
    tok.decoder = decoders.ByteLevel()
    # llama.cpp's token types: 3 control (special, like <|im_end|>), 4 user-defined (added,
    # matched whole in text but not special). Neither may be cut into pieces by BPE.
    types = list(_field(reader, keys.TOKEN_TYPE) or [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"the GGUF has {len(tokens)} tokens but {len(types)} token types")
    pairs = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == 3]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in pairs if k == 4])

    def token(key: str) -> str | None:
        tid = _field(reader, key)
        return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None

    config = {
        "bos_token": token(keys.BOS_ID),
        "eos_token": token(keys.EOS_ID),
        "add_bos_token": bool(_field(reader, keys.ADD_BOS, False)),
        "chat_template": _field(reader, keys.CHAT_TEMPLATE),
    }
    return tok, config


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", _GPT2_PRE):
        return byte_level
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    raise GGUFError(
        f"the GGUF's pre-tokenizer {pre!r} is not supported (supported: "
        f"{', '.join(PRE_TOKENIZERS)}); pass --tokenizer DIR with a tokenizer.json"
    )


def prepare_model_dir(gguf_path: Path, cache: Path, *, tokenizer: bool = True) -> Path:
    """A Hugging Face-style directory for `gguf_path` under `cache` (made once per file
    version and reused): config.json, the tokenizer files unless `tokenizer` is False, and
    ``model.gguf`` linking to the file. Bad files fail here, before any weight is loaded."""
    gguf_path = gguf_path.resolve()
    st = gguf_path.stat()
    key = f"{FORMAT_VERSION}|{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{tokenizer}"
    out = cache / "gguf" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (out / "config.json").exists():
        return out
    reader = open_gguf(gguf_path)
    config = hf_config(reader)
    check_tensor_types(reader)
    files = {"config.json": json.dumps(config, indent=1)}
    if tokenizer:
        tok, tok_config = build_tokenizer(reader)
        files["tokenizer.json"] = tok.to_str()
        files["tokenizer_config.json"] = json.dumps(tok_config, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    for name, text in files.items():
        (tmp / name).write_text(text)
    (tmp / "model.gguf").symlink_to(gguf_path)
    try:
        os.rename(tmp, out)  # atomic; engines started together may race here
    except OSError:
        if not (out / "config.json").exists():
            raise
        _remove_tree(tmp)  # another process made it first
    return out


def _remove_tree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
