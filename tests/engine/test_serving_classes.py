"""The serving classes on their own, without the FastAPI app: a real tokenizer and a
real Starlette request carrying a JSON body."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from infergate.engine.entrypoints.config import ServerConfig
from infergate.engine.entrypoints.errors import APIError
from infergate.engine.entrypoints.serving_models import OpenAIServingModels
from infergate.engine.entrypoints.serving_tokenization import OpenAIServingTokenization
from infergate.engine.tokenizer import Tokenizer
from starlette.requests import Request


def _request(body: dict[str, Any]) -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/tokenize", "headers": []}
    return Request(scope, receive)


@pytest.fixture
def serving(tiny_model_dir: Path) -> OpenAIServingTokenization:
    tok = Tokenizer(tiny_model_dir)
    config = ServerConfig(["tiny", "alias"], str(tiny_model_dir), 256, tok.vocab_size)
    return OpenAIServingTokenization(None, tok, config)  # type: ignore[arg-type]


async def test_tokenize_and_detokenize_round_trip(serving: OpenAIServingTokenization) -> None:
    out = await serving.tokenize(_request({"model": "alias", "prompt": "hello world"}))
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    back = await serving.detokenize(_request({"tokens": out["tokens"]}))
    assert back["prompt"].endswith("hello world")


async def test_errors_name_the_parameter(serving: OpenAIServingTokenization) -> None:
    cases: list[tuple[dict[str, Any], int, str]] = [({"model": "gpt-4", "prompt": "x"}, 404, "model"),
             ({"tokens": [10**9]}, 400, "tokens"), ({"prompt": 5}, 400, "prompt")]  # fmt: skip
    for body, status, param in cases:
        call = serving.detokenize if "tokens" in body else serving.tokenize
        with pytest.raises(APIError) as info:
            await call(_request(body))
        assert (info.value.status, info.value.param) == (status, param)


def test_models_lists_and_shows_served_names(tiny_model_dir: Path) -> None:
    models = OpenAIServingModels(ServerConfig(["tiny", "alias"], str(tiny_model_dir), 256, 439))
    assert [m["id"] for m in models.list()["data"]] == ["tiny", "alias"]
    assert models.show("alias")["max_model_len"] == 256
    with pytest.raises(APIError):
        models.show("other")
