"""GGUF loading: each supported type loads exactly, the tokenizer matches, bad files are named.

The files are the tiny model written by gguf's own writer and quantizers (gguf_files.py);
the real SmolLM2 file is checked against transformers in test_smollm2.py.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from infergate.engine.gguf_model import GGUFError, find_gguf, open_gguf, prepare_model_dir
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.tokenizer import Tokenizer

from .gguf_files import hf_weights, write_gguf

TEXTS = [
    "Hello, world! This is a test of the tokenizer.",
    "The capital of France is Paris.\n\nNumbers: 3.14, 2024 and 42.",
    "  leading spaces, tabs\tand ünïcödé — dashes",
]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", Q.Q8_0)


def _load(path: Path, cache: Path, quantization: str = "auto") -> TorchModelRunner:
    model_dir = prepare_model_dir(path, cache, tokenizer=False)
    return TorchModelRunner.from_model_dir(
        model_dir, num_blocks=8, device="cpu", dtype="float32", quantization=quantization
    )


@pytest.mark.parametrize(
    "qtype",
    [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1],
    ids=lambda q: q.name,
)
def test_each_type_loads_exactly(tiny_model_dir: Path, tmp_path: Path, qtype: Q) -> None:
    """Dequantized (``--quantization none``), every weight equals the Hugging Face one
    after the same quantize/dequantize round trip: names mapped, Q/K rows un-permuted,
    q/k/v and gate/up fused in the right places."""
    path = write_gguf(tiny_model_dir, tmp_path / "m.gguf", qtype)
    runner = _load(path, tmp_path, quantization="none")
    params = dict(runner.model.named_parameters())
    cfg = runner.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, value in hf_weights(tiny_model_dir).items():
        if value.ndim == 2 and qtype != Q.F32:
            value = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
        expected = torch.from_numpy(value.reshape(value.shape))
        for part, fused, rows in [
            (".q_proj.", ".qkv_proj.", (0, q)),
            (".k_proj.", ".qkv_proj.", (q, kv)),
            (".v_proj.", ".qkv_proj.", (q + kv, kv)),
            (".gate_proj.", ".gate_up_proj.", (0, cfg.intermediate_size)),
            (".up_proj.", ".gate_up_proj.", (cfg.intermediate_size, cfg.intermediate_size)),
        ]:
            if part in name:
                actual = params[name.replace(part, fused)].narrow(0, *rows)
                break
        else:
            actual = params[name]
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)


def test_config_comes_from_metadata(tiny_gguf: Path, tmp_path: Path) -> None:
    cfg = _load(tiny_gguf, tmp_path).config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (64, 128, 439)
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 4096
    assert cfg.tie_word_embeddings is False and cfg.eos_token_ids == (1, 4)


def test_tokenizer_matches_tokenizer_json(
    tiny_model_dir: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    """The BPE built from the GGUF's vocabulary and merges encodes as the original
    tokenizer.json does; special tokens, BOS/EOS and the chat template come along."""
    ours = Tokenizer(prepare_model_dir(tiny_gguf, tmp_path))
    ref = Tokenizer(tiny_model_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert (ours.bos_token_id, ours.eos_token_ids) == (ref.bos_token_id, ref.eos_token_ids)
    assert ours.special_token_ids == ref.special_token_ids
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages)


def test_model_dir_is_reused(tiny_gguf: Path, tmp_path: Path) -> None:
    first = prepare_model_dir(tiny_gguf, tmp_path)
    assert prepare_model_dir(tiny_gguf, tmp_path) == first
    assert (first / "model.gguf").resolve() == tiny_gguf.resolve()


def test_truncated_file_is_named(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    for keep in (len(data) - 1000, 200):  # tensor data cut short; the header cut short
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(GGUFError, match="is truncated"):
            prepare_model_dir(cut, tmp_path)


def test_not_a_gguf_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        open_gguf(path)


def test_unsupported_quantization_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(
        tiny_model_dir, tmp_path / "k.gguf", raw_tensor=("blk.0.ffn_up.weight", Q.Q4_K)
    )
    with pytest.raises(
        GGUFError, match=r"blk\.0\.ffn_up\.weight is quantized as Q4_K, which is not"
    ):
        prepare_model_dir(path, tmp_path)


def test_unknown_quantization_is_named(tiny_gguf: Path, tmp_path: Path) -> None:
    """A type id the gguf package does not know (a newer llama.cpp's, or corruption)."""
    data = bytearray(tiny_gguf.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)  # the tensor's type id
    path = tmp_path / "unknown.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"unknown quantization type .*99"):
        prepare_model_dir(path, tmp_path)


def test_unsupported_architecture_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_model_dir, tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(
        GGUFError, match=r"architecture 'gpt2' is not supported \(supported: llama\)"
    ):
        prepare_model_dir(path, tmp_path)


def test_sentencepiece_vocabulary_needs_tokenizer_flag(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = write_gguf(tiny_model_dir, tmp_path / "sp.gguf", tokenizer_model="llama")
    with pytest.raises(GGUFError, match=r"only byte-level BPE .* --tokenizer"):
        prepare_model_dir(path, tmp_path)
    assert (prepare_model_dir(path, tmp_path, tokenizer=False) / "config.json").exists()


def test_unknown_pre_tokenizer_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_model_dir, tmp_path / "pre.gguf", pre="chatglm-bpe")
    with pytest.raises(GGUFError, match="pre-tokenizer 'chatglm-bpe' is not supported"):
        prepare_model_dir(path, tmp_path)


def test_find_gguf(tiny_gguf: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    assert find_gguf(tiny_gguf) == tiny_gguf
    assert find_gguf(tiny_model_dir) is None  # a Hugging Face directory stays one
    shutil.copy(tiny_gguf, tmp_path / "a.gguf")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    shutil.copy(tiny_gguf, tmp_path / "b.gguf")
    with pytest.raises(GGUFError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        find_gguf(tmp_path)


def test_serve_reports_a_bad_file(
    tiny_gguf: Path, tmp_path: Path, infergate_cli: list[str]
) -> None:
    """`infergate engine serve` on a truncated GGUF: one line naming the problem, exit 2."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-1000])
    proc = subprocess.run(
        [*infergate_cli, "engine", "serve", str(cut), "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
        env={"INFERGATE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"error: cannot serve {cut}: {cut} is truncated" in proc.stderr


def test_tokenizer_flag_serves_a_gguf_whose_vocabulary_is_not_converted(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tokenizer DIR: the GGUF's own vocabulary is not read, the directory's is used."""
    from infergate.engine.serve import ServeOptions, build

    monkeypatch.setenv("INFERGATE_CACHE_DIR", str(tmp_path))
    path = write_gguf(tiny_model_dir, tmp_path / "sp.gguf", tokenizer_model="llama")
    app = build(ServeOptions(model_dir=path, tokenizer=tiny_model_dir, device="cpu"))
    assert app is not None
