"""vLLM command-line flags pasted from GIE/llm-d manifests: honoured or no-ops.

One real engine started with the flags a vLLM manifest carries, a generation_config.json
that makes omitted sampling fields greedy, and a custom chat template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from infergate.procs import ProcessGroup

from .conftest import MODEL, Server, _start

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module")
def flagged_server(
    tiny_model_dir: Path, infergate_cli: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    gen_dir = tmp_path_factory.mktemp("gen-config")
    (gen_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-flags", tiny_model_dir,
            "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "64",
            "--trust-remote-code", "--disable-log-requests", "--tensor-parallel-size", "1",
            "--generation-config", str(gen_dir), "--chat-template", TEMPLATE,
        )  # fmt: skip


def test_generation_config_defaults_apply_when_omitted(flagged_server: Server) -> None:
    client = flagged_server.client()
    texts = {
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=8, seed=seed, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for seed in (1, 2, 3)
    }
    assert len(texts) == 1  # temperature 0 from generation_config.json: seeds do not matter
    hot = {
        client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=8,
            seed=seed,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for seed in (1, 2, 3)
    }
    assert len(hot) > 1  # a request's own temperature wins


def test_chat_template_flag_is_used(flagged_server: Server) -> None:
    with flagged_server.http() as http:
        ids = http.post(
            "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        ).json()["tokens"]
        text = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert text == "<<hi>>"


def test_model_by_id_and_unknown_routes(sim_server: Server) -> None:
    with sim_server.http() as http:
        card = http.get(f"/v1/models/{MODEL}")
        assert card.status_code == 200 and card.json()["id"] == MODEL
        missing = http.get("/v1/models/gpt-4")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        for method, path in (("GET", "/v1/nope"), ("POST", "/v1/embeddings"), ("GET", "/x")):
            res = http.request(method, path)
            assert res.status_code == 404
            assert set(res.json()["error"]) == {"message", "type", "param", "code"}
        wrong = http.get("/v1/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
