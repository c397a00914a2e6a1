"""`make-tiny-model`: deterministic, loadable by `transformers` offline, lossless tokenizer."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from infergate.engine.tiny_model import make_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, 日本語, emoji 🙂 and tabs\tand\nnewlines",
    "  leading spaces and odd punctuation ?!…",
]


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path, arch: str) -> None:
    a = _digest(make_tiny_model(tmp_path / "a", arch=arch, seed=1))
    b = _digest(make_tiny_model(tmp_path / "b", arch=arch, seed=1))
    c = _digest(make_tiny_model(tmp_path / "c", arch=arch, seed=2))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_transformers_loads_it(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert 256 < len(tok) <= 1024
    assert cfg["vocab_size"] == len(tok)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == cfg["architectures"][0]
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"])
    assert torch.isfinite(logits).all()


def test_llama_chat_template_and_special_tokens(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok("hi").input_ids[0] == tok.bos_token_id
    assert tok.convert_tokens_to_ids("<|eot_id|>") in gen["eos_token_id"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Special tokens are single ids, not spelled out byte by byte.
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|start_header_id|>")) == 2


def test_qwen3_chatml_template(tiny_qwen3_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token is None
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_sharded_output_has_index(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", arch="qwen3", num_shards=3)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) == 3
    assert all((d / s).exists() for s in shards)
    assert not (d / "model.safetensors").exists()


def test_cli_writes_a_loadable_model(tmp_path: Path, infergate_cli: list[str]) -> None:
    out = tmp_path / "cli-model"
    subprocess.run(
        [*infergate_cli, "engine", "make-tiny-model", str(out), "--arch", "qwen3"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    bad = subprocess.run(
        [*infergate_cli, "engine", "make-tiny-model", str(out), "--arch", "gpt9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "gpt9" in bad.stderr or "arch" in bad.stderr
