"""The real tiny model behind the server: greedy output equals `transformers`.

The server runs with an 8-token budget, so every prompt is prefilled in chunks that
share batches with other requests' decodes, and a repeated prompt hits the prefix cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from .conftest import API_KEY, MODEL, Server

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A gateway routes each request.",
    "Once upon a time there was a small town by the sea.",
    "Large language models generate text one token at a time.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy generate, never stopping at EOS (the engine uses ignore_eos).

    ``use_cache=False``: with transformers 5.23 the cached generate path of this tiny
    Llama-3 (rope scaling) gives logits that differ from a plain forward pass by several
    units, while the uncached path equals the forward pass (checked by engine-models'
    logits test); the uncached path is the reference.
    """
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=1,
        use_cache=False,
    )  # fmt: skip
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return [int(t) for t in out[0, len(prompt) :]]


def engine_greedy(server: Server, prompt: str) -> dict[str, Any]:
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    res = httpx.post(
        f"{server.url}/v1/completions", json=body, timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    assert res.status_code == 200, res.text
    return dict(res.json())


def test_greedy_matches_transformers_with_chunking_batching_and_prefix_hits(
    real_server: Server, hf_model: Any
) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: decodes mix with chunks
        first = list(pool.map(lambda p: engine_greedy(real_server, p), PROMPTS))
    again = engine_greedy(real_server, PROMPTS[0])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    for res in [*first, again]:
        choice = res["choices"][0]
        expected = hf_greedy(hf_model, choice["prompt_token_ids"])
        assert choice["token_ids"] == expected
    assert len({t for r in first for t in r["choices"][0]["token_ids"]}) > 8  # not degenerate
    real_server.wait_idle()


def test_chat_and_streaming_on_the_real_model(real_server: Server) -> None:
    client = real_server.client()
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    done = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == done.choices[0].message.content
    assert done.choices[0].finish_reason in ("stop", "length")
    seeded = [
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
