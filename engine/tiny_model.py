"""A tiny random-weight model in Hugging Face format, built locally for tests and demos.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a small built-in
English corpus (so any text round-trips losslessly), and the weights are seeded random
tensors. The layout is exactly what `transformers` and our own loader expect, so the same
directory serves the engine, the correctness tests against `transformers`, and demos.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen3")

# Small but shaped like the real thing: GQA (4 query heads over 2 KV heads), explicit
# head_dim, SwiGLU MLP. Big enough to catch layout bugs, small enough to run in ms.
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
MAX_POSITIONS = 4096
TARGET_VOCAB = 1024

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A gateway routes each request to the model
server that can answer it fastest. When many users share the same system prompt, the
server that already holds that prefix in its cache can skip most of the work.
Once upon a time there was a small town by the sea. Every morning the fishermen went out
in their boats, and every evening they came back with stories about the weather, the
waves and the birds that followed them home. The children played on the beach until the
sun went down, and their parents called them in for dinner.
How are you today? I am fine, thank you. What is the capital of France? The capital of
France is Paris. Can you tell me a story about a dragon? Sure, here is a short story.
Please write a poem about the ocean. Explain how a computer works in simple words.
Hello, world! This is a test of the tokenizer. Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
10, 42, 100, 2024 and 3.14 appear in text too, as do symbols: (a + b) * c = d; x < y > z.
Large language models generate text one token at a time. Each new token attends to all
the tokens before it, whose keys and values are kept in a cache made of fixed-size blocks.
A scheduler decides which requests run in each step, mixing new prompts with ongoing
generations, so that the accelerator stays busy and no request waits too long.
The system, the model, the user and the assistant took turns. You said something, then I
answered, and we went on talking about what we would do next week and where we should go.
She reads books in the library, he writes letters to his friends, and they both like to
walk in the park when the weather is good. It was a bright cold day in April.
"""

_LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class _ArchSpec:
    architecture: str
    model_type: str
    specials: tuple[str, ...]  # special tokens, in id order right after the byte alphabet
    bos: str | None
    eos: str  # the chat end-of-turn token (what the tokenizer reports as eos)
    extra_eos: tuple[str, ...]  # further stop tokens for generation_config
    pad: str
    chat_template: str
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool


_SPECS = {
    "llama": _ArchSpec(
        architecture="LlamaForCausalLM",
        model_type="llama",
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        extra_eos=("<|end_of_text|>",),
        pad="<|end_of_text|>",
        chat_template=_LLAMA_CHAT_TEMPLATE,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen3": _ArchSpec(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        extra_eos=("<|endoftext|>",),
        pad="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def _build_tokenizer(spec: _ArchSpec) -> Any:
    """Byte-level BPE trained on the built-in corpus; lossless for any UTF-8 text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        min_frequency=2,
        special_tokens=list(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if spec.bos is not None:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A",
            pair=f"{spec.bos} $A {spec.bos} $B",
            special_tokens=[(spec.bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _config(spec: _ArchSpec, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "bos_token_id": ids[spec.bos] if spec.bos else None,
        "eos_token_id": ids[spec.eos],
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if spec.model_type == "llama":
        # Llama-3 style frequency scaling. With head_dim 16 and theta 5e5 the band edges
        # below put some frequencies in each regime (kept, smoothed, divided by factor).
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        cfg["pretraining_tp"] = 1
    else:
        cfg["rope_scaling"] = None
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = LAYERS
    return cfg


def _weights(spec: _ArchSpec, vocab_size: int, seed: int) -> dict[str, Any]:
    """Seeded random weights under Hugging Face names, stored as bfloat16.

    Scales are larger than the usual tiny init so that logits are well spread (near-ties
    would make greedy comparisons against `transformers` flaky), and the residual branches
    outweigh the embedding so a tied-embedding model does not just repeat its last token.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return randn(out_f, in_f, std=gain * in_f**-0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + randn(n, std=0.1)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": randn(vocab_size, HIDDEN, std=0.2)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = linear(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = linear(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = linear(HIDDEN, HEADS * HEAD_DIM, gain=3.0)
        if spec.model_type == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        w[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        w[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE, gain=3.0)
    w["model.norm.weight"] = norm(HIDDEN)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = randn(vocab_size, HIDDEN, std=3.0 * HIDDEN**-0.5)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}


def _save_weights(out: Path, weights: dict[str, Any], num_shards: int) -> None:
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    if num_shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata=meta)
        return
    names = list(weights)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::num_shards]}
        save_file(part, str(out / fname), metadata=meta)
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny_model(
    out_dir: str | Path, arch: str = "llama", seed: int = 0, *, num_shards: int = 1
) -> Path:
    """Write a tiny random `arch` model (llama or qwen3) into `out_dir`; return the path.

    Deterministic for a given (arch, seed, num_shards). `num_shards > 1` writes sharded
    safetensors with a `model.safetensors.index.json`, as large checkpoints ship.
    """
    if arch not in _SPECS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    spec = _SPECS[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = _build_tokenizer(spec)
    vocab_size = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in spec.specials}
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in spec.specials
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "unk_token": None,
        "add_bos_token": spec.bos is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "added_tokens_decoder": added,
        "chat_template": spec.chat_template,
    }
    _write_json(out / "tokenizer_config.json", tok_cfg)
    special_map = {"eos_token": spec.eos, "pad_token": spec.pad}
    if spec.bos:
        special_map["bos_token"] = spec.bos
    _write_json(out / "special_tokens_map.json", special_map)

    _write_json(out / "config.json", _config(spec, vocab_size, ids))
    eos_ids = [ids[spec.eos], *(ids[t] for t in spec.extra_eos)]
    gen_cfg: dict[str, Any] = {"eos_token_id": eos_ids, "pad_token_id": ids[spec.pad]}
    if spec.bos:
        gen_cfg["bos_token_id"] = ids[spec.bos]
    _write_json(out / "generation_config.json", gen_cfg)

    _save_weights(out, _weights(spec, vocab_size, seed), num_shards)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
