"""Shared engine fixtures: tiny random models built locally once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from infergate.engine.tiny_model import make_tiny_model

# Nothing in the engine tests may reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA, Llama-3 rope scaling, untied embeddings) in HF format."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 dense model (q/k norm, tied embeddings) in HF format."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", seed=0)
