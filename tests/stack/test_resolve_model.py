"""``infergate up --model``: what it accepts (a directory, a GGUF, a fetched model's name)."""

from __future__ import annotations

from pathlib import Path

import pytest
from infergate.engine import fetch

from infergate.stack.local import LocalStack, StackError, StackSpec, resolve_model


def test_directories_and_gguf_files_are_accepted(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(hf) == hf
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf) == gguf
    assert resolve_model(tmp_path) == tmp_path  # a directory holding a GGUF


def test_a_model_name_is_fetched_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """smollm2 resolves to the fetched GGUF (here already in the cache: pip is not run)."""
    path = fetch.model_path("smollm2", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    assert resolve_model(Path("smollm2"), tmp_path) == path
    assert LocalStack(StackSpec(model=Path("smollm2"))).model_name == "smollm2"
    assert LocalStack(StackSpec(model=tmp_path / "x.gguf")).model_name == "x"


def test_anything_else_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StackError, match=r"not a Hugging Face model directory, a \.gguf file"):
        resolve_model(tmp_path / "nothing")
    with pytest.raises(StackError, match="smollm2"):
        resolve_model(tmp_path)  # an empty directory
