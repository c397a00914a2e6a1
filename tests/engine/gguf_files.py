"""Write small GGUF files for tests, from the tiny Hugging Face model, with gguf's writer.

The conversion is done the way llama.cpp's converter lays a Llama out (tensor names,
Q/K rows permuted for its rope kernel, metadata keys), with the weights quantized by
gguf's own quantizers, so the engine's reader is tested against files it did not write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem.startswith("model.layers."):
        layer, part = stem.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_LAYER[part]}.{kind}"
    return f"{_TOP[stem]}.{kind}"


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: each head's halves interleaved pairwise."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(model_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(str(path)).items()})
    return out


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: Q = Q.F32,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str | None = None,
    raw_tensor: tuple[str, Q] | None = None,
) -> Path:
    """`model_dir` (a tiny Llama) as a GGUF: 2-D weights stored as `qtype`, norms as F32.

    `raw_tensor` = (gguf name, type) stores that tensor as zero bytes of another type
    (a file whose quantization the engine should refuse)."""
    cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    tok: dict[str, Any] = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg: dict[str, Any] = json.loads((model_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(out, arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    vocab: dict[str, int] = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted({**vocab, **added}, key=lambda t: {**vocab, **added}[t])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    w.add_token_merges(merges)
    # As in Llama 3's files: EOS is <|end_of_text|>, the turn's end <|eot_id|> is EOT.
    w.add_bos_token_id(added[tok_cfg["bos_token"]])
    w.add_eos_token_id(added["<|end_of_text|>"])
    w.add_eot_token_id(added[tok_cfg["eos_token"]])
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    if tok_cfg.get("chat_template"):
        w.add_chat_template(tok_cfg["chat_template"])
    for hf, value in hf_weights(model_dir).items():
        name = gguf_name(hf)
        if ".attn_q." in name:
            value = permute(value, heads)
        elif ".attn_k." in name:
            value = permute(value, kv_heads)
        if raw_tensor is not None and name == raw_tensor[0]:
            block, nbytes = gguf.GGML_QUANT_SIZES[raw_tensor[1]]
            rows, cols = value.shape
            raw = np.zeros((rows, cols // block * nbytes), dtype=np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=raw_tensor[1])
        elif value.ndim == 2 and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
