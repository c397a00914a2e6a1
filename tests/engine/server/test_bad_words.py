"""vLLM's ``bad_words`` through the real `openai` client on the real tiny model."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from infergate.engine.sampler import bad_word_blocks

from .conftest import MODEL, Server

PROMPT = "Once upon a time"


def _single_token_text(server: Server, token: int) -> str:
    with server.http() as http:
        text = http.post("/detokenize", json={"model": MODEL, "tokens": [token]}).json()["prompt"]
        ids = http.post("/tokenize", json={"model": MODEL, "prompt": text.lstrip(),
                                           "add_special_tokens": False}).json()["tokens"]  # fmt: skip
    assert ids == [token], "pick a token that is a word on its own"
    return str(text)


@pytest.mark.parametrize("stream", [False, True])
def test_banned_word_never_appears_even_against_a_bias(real_server: Server, stream: bool) -> None:
    token = 300
    word = _single_token_text(real_server, token)
    client = real_server.client()
    body: dict[str, Any] = {"logit_bias": {str(token): 100}, "temperature": 0,
                            "ignore_eos": True}  # fmt: skip

    def ids(extra: dict[str, Any]) -> list[int]:
        res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                        extra_body={**body, **extra, "return_token_ids": True})  # fmt: skip
        return list(res.choices[0].model_extra["token_ids"])  # type: ignore[index]

    if not stream:
        assert ids({}) == [token] * 6  # the bias alone wins every step
        assert token not in ids({"bad_words": [word]})
    else:
        res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                                        extra_body={**body, "bad_words": [word]})  # fmt: skip
        text = "".join(c.choices[0].text for c in res if c.choices)
        assert word.strip() not in text


def test_bad_words_bad_values(real_server: Server) -> None:
    for value in ([""], "word", [3]):
        with pytest.raises(openai.BadRequestError) as info:
            real_server.client().completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"bad_words": value}
            )
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "bad_words"


def test_multi_token_words_ban_only_their_last_token_after_the_prefix() -> None:
    words = [(5,), (7, 8), (1, 2, 3)]
    assert bad_word_blocks(words, []) == (5,)
    assert bad_word_blocks(words, [9, 7]) == (5, 8)
    assert bad_word_blocks(words, [1, 2]) == (5, 3)
    assert bad_word_blocks(words, [2, 1]) == (5,)
