"""Sampling parameters through the real `openai` client on the real tiny model.

Each assertion is one the parameter makes certain whatever the random weights: a +100
logit bias wins every greedy step, min_p=1 keeps only the top token, a huge repetition
penalty forbids every token already seen, min_tokens holds back a biased EOS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from .conftest import MODEL, Server

PROMPT = "Once upon a time there was a small town by the sea."


@pytest.fixture(scope="module")
def eos_id(tiny_model_dir: Path) -> int:
    return int(AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id)


def ids_of(server: Server, **kwargs: Any) -> tuple[list[int], Any]:
    body = {"model": MODEL, "prompt": PROMPT, "return_token_ids": True, **kwargs}
    with server.http() as http:
        res = http.post("/v1/completions", json=body)
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    return choice["token_ids"], res.json()


def test_logit_bias_wins_greedy_steps_stream_and_not(real_server: Server) -> None:
    token = 42
    got, _ = ids_of(real_server, max_tokens=5, temperature=0, ignore_eos=True,
                    logit_bias={str(token): 100})  # fmt: skip
    assert got == [token] * 5
    client = real_server.client()
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            logit_bias={str(token): 100},
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
        logit_bias={str(token): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert text == whole.choices[0].text


def test_min_p_one_is_greedy(real_server: Server) -> None:
    greedy, _ = ids_of(real_server, max_tokens=8, temperature=0, ignore_eos=True)
    sampled, _ = ids_of(real_server, max_tokens=8, temperature=1.0, min_p=1.0, seed=3,
                        ignore_eos=True)  # fmt: skip
    assert sampled == greedy


def test_huge_repetition_penalty_never_repeats(real_server: Server) -> None:
    got, _ = ids_of(real_server, max_tokens=12, temperature=0, ignore_eos=True,
                       repetition_penalty=1e9)  # fmt: skip
    prompt = set(ids_of(real_server, max_tokens=1)[1]["choices"][0]["prompt_token_ids"])
    assert len(set(got)) == len(got)
    assert not set(got) & prompt


def test_presence_and_frequency_penalties_change_greedy_repeats(real_server: Server) -> None:
    """A biased token repeats; a frequency penalty above the bias stops the repeats."""
    token = 42
    biased, _ = ids_of(real_server, max_tokens=6, temperature=0, ignore_eos=True,
                       logit_bias={str(token): 30})  # fmt: skip
    assert biased.count(token) == 6
    penalised, _ = ids_of(real_server, max_tokens=6, temperature=0, ignore_eos=True,
                          logit_bias={str(token): 30}, frequency_penalty=2.0,
                          presence_penalty=2.0, repetition_penalty=1e9)  # fmt: skip
    assert penalised.count(token) == 1


def test_min_tokens_holds_back_eos(real_server: Server, eos_id: int) -> None:
    free, body = ids_of(real_server, max_tokens=10, temperature=0, logit_bias={str(eos_id): 100})
    assert free == [eos_id] and body["choices"][0]["finish_reason"] == "stop"
    held, body = ids_of(real_server, max_tokens=10, temperature=0, min_tokens=4,
                        logit_bias={str(eos_id): 100})  # fmt: skip
    assert len(held) == 5 and held[-1] == eos_id and eos_id not in held[:4]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output(real_server: Server) -> None:
    client = real_server.client()
    base = (
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = base[3:6]
    assert stop.strip(), "the tiny model's greedy text should have printable characters"
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    kept = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    ).choices[0].text  # fmt: skip
    assert kept == cut + stop
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        )
        if c.choices
    )
    assert streamed == kept


def test_continuous_usage_stats(any_server: Server) -> None:
    client = any_server.client()
    chunks = list(client.completions.create(  # type: ignore[call-overload]
        model=MODEL, prompt=PROMPT, max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] == 5
    chat = list(client.chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert any(c.choices and c.usage is not None for c in chat)


def test_stream_null_is_false(any_server: Server) -> None:
    with any_server.http() as http:
        res = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": None}
        )
    assert res.status_code == 200 and res.json()["object"] == "text_completion"


BAD = [
    ("temperature", "NaN"),
    ("top_p", "NaN"),
    ("presence_penalty", "3"),
    ("frequency_penalty", "-2.5"),
    ("repetition_penalty", "0"),
    ("min_p", "1.5"),
    ("min_tokens", "-1"),
    ("min_tokens", "50"),
    ("logit_bias", '{"abc": 1}'),
    ("logit_bias", '{"5": 200}'),
    ("logit_bias", '{"99999999": 1}'),
    ("bad_words", '[""]'),
    ("bad_words", '"x"'),
    ("spaces_between_special_tokens", "false"),
    ("suffix", '"tail"'),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("param", "raw"), BAD)
def test_bad_sampling_values_name_the_parameter(
    sim_server: Server, param: str, raw: str, stream: bool
) -> None:
    body = (f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 4, '
            f'"stream": {json.dumps(stream)}, "{param}": {raw}}}')  # fmt: skip
    with sim_server.http() as http:
        res = http.post("/v1/completions", content=body,
                        headers={"content-type": "application/json"})  # fmt: skip
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def partial_utf8_token(tiny_model_dir: Path) -> int:
    """A token that is a lone UTF-8 lead/continuation byte (decodes to U+FFFD alone)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")


@pytest.mark.parametrize("stream", [False, True])
def test_trailing_incomplete_utf8_is_flushed(
    real_server: Server, partial_utf8_token: int, stream: bool
) -> None:
    """A stream ending inside a UTF-8 sequence ends with U+FFFD, not silently nothing."""
    client = real_server.client()
    args: dict[str, Any] = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
        "logit_bias": {str(partial_utf8_token): 100}, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    if stream:
        text = "".join(
            c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices
        )
    else:
        text = client.completions.create(**args).choices[0].text
    assert text == "\ufffd"
