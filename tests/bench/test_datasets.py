"""Prompt sets and request bodies of ``infergate bench serve``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infergate.bench.client import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, build_payload
from infergate.bench.datasets import (
    Tokens,
    jsonl_dataset,
    random_dataset,
    shared_prefix_dataset,
)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    from infergate.engine.tiny_model import make_tiny_model

    directory = tmp_path_factory.mktemp("tiny")
    make_tiny_model(directory)
    return Tokens(directory)


def test_random_prompts_have_exact_token_lengths_with_a_tokenizer(tokens: Tokens) -> None:
    samples = random_dataset(20, 64, 8, range_ratio=0.5, tokens=tokens, seed=3)
    assert len({s.prompt for s in samples}) == 20
    for sample in samples:
        assert sample.prompt_len is not None
        assert sample.prompt_len == tokens.count(sample.prompt)
        assert 32 <= sample.prompt_len <= 96 + 4  # + the unique "N: " lead
        assert 4 <= sample.output_len <= 12
    again = random_dataset(20, 64, 8, range_ratio=0.5, tokens=tokens, seed=3)
    assert [s.prompt for s in again] == [s.prompt for s in samples]  # seeded


def test_shared_prefix_groups_share_their_system_prompt() -> None:
    samples = shared_prefix_dataset(
        24, num_groups=3, prefix_len=200, suffix_len=10, output_len=5, seed=0
    )
    by_group: dict[int, set[str]] = {}
    for sample in samples:
        assert sample.group is not None and sample.system is not None
        by_group.setdefault(sample.group, set()).add(sample.system)
    assert sorted(by_group) == [0, 1, 2]
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == 3
    assert len({s.prompt for s in samples}) == 24  # every question differs
    with pytest.raises(ValueError):
        shared_prefix_dataset(4, num_groups=0, prefix_len=5, suffix_len=5, output_len=5)


def test_jsonl_prompts_messages_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "hello", "output_len": 7})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    samples = jsonl_dataset(good, 5, default_output_len=3)
    assert [s.output_len for s in samples] == [7, 3, 7, 3, 7]
    assert samples[1].messages == [{"role": "user", "content": "hi"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        jsonl_dataset(bad, 1, 3)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        jsonl_dataset(bad, 1, 3)


def test_payloads_stream_with_usage_for_both_endpoints() -> None:
    sample = shared_prefix_dataset(1, num_groups=1, prefix_len=5, suffix_len=3, output_len=9)[0]
    chat = build_payload(sample, endpoint=CHAT_ENDPOINT, model="m")
    assert chat["messages"][0] == {"role": "system", "content": sample.system}
    assert chat["messages"][1]["content"] == sample.prompt
    completion = build_payload(sample, endpoint=COMPLETIONS_ENDPOINT, model="m", ignore_eos=True)
    assert sample.system is not None
    assert completion["prompt"].startswith(sample.system)
    assert completion["ignore_eos"] is True
    for body in (chat, completion):
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 9
