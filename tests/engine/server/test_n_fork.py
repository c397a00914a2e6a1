"""``n`` through the real server on the real tiny model: the samples share one prefill
(a forked block table) and still give exactly what the same requests give one by one."""

from __future__ import annotations

from typing import Any

from .conftest import MODEL, Server

PROMPT = "Every sample of this prompt reads the same keys and values from the paged cache."


def _tokens(server: Server, path: str, body: dict[str, Any]) -> list[list[int]]:
    with server.http() as http:
        response = http.post(path, json={"model": MODEL, "return_token_ids": True, **body})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def test_n4_equals_the_same_samples_one_by_one(real_server: Server) -> None:
    real_server.wait_idle()
    common = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ):
        together = _tokens(real_server, path, {**body, **common, "n": 4, "seed": 40})
        alone = [
            _tokens(real_server, path, {**body, **common, "seed": 40 + j})[0] for j in range(4)
        ]
        assert together == alone, path
        assert len({tuple(t) for t in together}) == 4
    real_server.wait_idle()  # every shared block was given back
