"""Logprobs, echo, prompt logprobs, prompt lists and n>1 through the real `openai` client.

The real tiny model's prompt logprobs are checked against `transformers` on the same
weights: the loglikelihood path lm-eval uses (echo, logprobs, max_tokens 0) must give
the model's own numbers, whatever the chunking of the prefill (the server's budget is
8 tokens, so a prompt spans several steps).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from .conftest import API_KEY, MODEL, Server

PROMPT = "The quick brown fox jumps over the lazy dog near the river bank today."


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    res = httpx.post(
        f"{server.url}{path}", json=body, timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    assert res.status_code == 200, res.text
    return dict(res.json())


def prompt_ids(server: Server, text: str) -> list[int]:
    return list(post(server, "/tokenize", {"model": MODEL, "prompt": text})["tokens"])


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_prompt_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from a plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = logits.log_softmax(dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_echo_max_tokens_0_gives_the_models_prompt_logprobs(
    real_server: Server, hf_model: Any
) -> None:
    ids = prompt_ids(real_server, PROMPT)
    client = real_server.client()
    out = client.completions.create(
        model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None
    expected = hf_prompt_logprobs(hf_model, ids)
    got = lp.token_logprobs[1:]
    assert all(g is not None for g in got)
    assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < 1e-3
    assert choice.text == PROMPT or choice.text.endswith(PROMPT)
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == len(ids)
    # top_logprobs: the chosen token is in each dict, and the top-1's value is the max
    tops = lp.top_logprobs
    assert tops is not None and tops[0] is None
    for token, value, top in zip(lp.tokens[1:], got, tops[1:], strict=True):
        assert top is not None and token in top and top[token] == value
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_generation_and_sampled_logprobs(real_server: Server) -> None:
    ids = prompt_ids(real_server, PROMPT)
    client = real_server.client()
    out = client.completions.create(
        model=MODEL, prompt=ids, echo=True, max_tokens=4, logprobs=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None
    assert len(lp.tokens) == len(ids) + 4
    for value, top in zip(lp.token_logprobs[len(ids) :], lp.top_logprobs[len(ids) :], strict=True):
        assert value is not None and value <= 0
        assert top is not None and 3 <= len(top) <= 4
        assert value == max(top.values())  # greedy: the chosen token is the most likely


def test_logprobs_stream_equals_whole(real_server: Server) -> None:
    client = real_server.client()
    args: dict[str, Any] = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    whole = client.completions.create(**args)
    whole_lp = whole.choices[0].logprobs
    assert whole_lp is not None and whole_lp.token_logprobs is not None
    streamed: list[float | None] = []
    tokens: list[str] = []
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.token_logprobs or []
                tokens += choice.logprobs.tokens or []
    assert len(whole_lp.token_logprobs) == 6
    assert tokens == whole_lp.tokens
    assert streamed == pytest.approx(whole_lp.token_logprobs, abs=1e-5)


def test_sampled_logprobs_are_after_temperature(real_server: Server) -> None:
    """Temperature 2 flattens the distribution: the top-1 logprob is below greedy's."""
    client = real_server.client()
    cold = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, temperature=0
    )
    hot = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, temperature=2.0, seed=1
    )
    cold_top = cold.choices[0].logprobs.top_logprobs[0]  # type: ignore[union-attr,index]
    hot_top = hot.choices[0].logprobs.top_logprobs[0]  # type: ignore[union-attr,index]
    assert max(hot_top.values()) < max(cold_top.values())


def test_prompt_logprobs_extension(real_server: Server, hf_model: Any) -> None:
    ids = prompt_ids(real_server, PROMPT)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    choice = post(real_server, "/v1/completions", body)["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    expected = hf_prompt_logprobs(hf_model, ids)
    for token, entry, want in zip(ids[1:], plp[1:], expected, strict=True):
        assert math.isclose(entry[str(token)]["logprob"], want, abs_tol=1e-3)
        assert entry[str(token)]["rank"] >= 1
        assert 2 <= len(entry) <= 3


def test_prompt_list_and_n(real_server: Server) -> None:
    prompts = ["Once upon a time", "A gateway routes each request"]
    lengths = [len(prompt_ids(real_server, p)) for p in prompts]
    client = real_server.client()
    out = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(lengths)
    assert out.usage.completion_tokens == 12
    # The same request again: same seed, same texts (per-choice seeds are seed + j).
    again = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_prompt_list_of_token_ids_streamed(real_server: Server) -> None:
    ids = [prompt_ids(real_server, p) for p in ("Hello there", "General Kenobi")]
    client = real_server.client()
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    for index, prompt in enumerate(ids):
        one = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert texts[index] == one.choices[0].text


def test_chat_logprobs_stream_and_not(real_server: Server) -> None:
    client = real_server.client()
    args: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert content is not None and len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.logprob == item.top_logprobs[0].logprob  # greedy picks the top-1
        assert item.bytes == list(item.token.encode())
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += [i.logprob for i in choice.logprobs.content]
    assert streamed == pytest.approx([i.logprob for i in content], abs=1e-5)


def test_simulated_engine_refuses_logprobs(sim_server: Server) -> None:
    client = sim_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", logprobs=1, max_tokens=2)
    assert info.value.body["param"] == "logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", logprobs=1, max_tokens=2, stream=True)
    assert info.value.body["param"] == "logprobs"  # type: ignore[index]


def test_chat_n_stream_and_not(any_server: Server) -> None:
    client = any_server.client()
    args: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me"}], "n": 3,
        "max_tokens": 4, "temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    whole = client.chat.completions.create(**args)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_best_of_returns_the_most_likely_samples(real_server: Server) -> None:
    """best_of=4, n=2 returns the 2 of the same 4 seeded samples with the highest
    cumulative logprob (the 4 are seen with n=4 and logprobs=0)."""
    client = real_server.client()
    args: dict[str, Any] = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 11,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    every = client.completions.create(**args, n=4, logprobs=0)
    ranked = sorted(
        every.choices,
        key=lambda c: -sum(c.logprobs.token_logprobs or []),
    )
    best = client.completions.create(**args, n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in best.choices)  # not asked for: not returned
