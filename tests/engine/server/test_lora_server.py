"""LoRA through the real `infergate engine serve` process and the `openai` client.

A real CPU engine serves the tiny model with adapters from ``--lora-modules`` (both of
vLLM's forms) and runtime loading opted in (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):
requests naming an adapter run with it (checked against the engine's own base-model
output and against each other), ``/v1/models`` lists adapters with their parent, and
bad input — an unknown adapter, a missing path, a corrupt file, a rank above
``--max-lora-rank`` — gets a clear error while the engine keeps serving.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from infergate.engine.lora.tiny import make_tiny_lora
from prometheus_client.parser import text_string_to_metric_families

from infergate.procs import ProcessGroup

from .conftest import MODEL, Server, _start

PROMPT = "Once upon a time there was a small town by the sea."


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    return {
        "attn": make_tiny_lora(tiny_model_dir, root / "attn", seed=1, rank=8,
                               target_modules=("q_proj", "v_proj", "o_proj")),
        "mlp": make_tiny_lora(tiny_model_dir, root / "mlp", seed=2, rank=4,
                              target_modules=("gate_proj", "down_proj")),
        "late": make_tiny_lora(tiny_model_dir, root / "late", seed=3, rank=8,
                               target_modules=("k_proj", "up_proj")),
        "wide": make_tiny_lora(tiny_model_dir, root / "wide", seed=4, rank=16),
    }  # fmt: skip


@pytest.fixture(scope="module")
def lora_server(
    tiny_model_dir: Path, infergate_cli: list[str], adapters: dict[str, Path]
) -> Iterator[Server]:
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        with ProcessGroup() as group:
            yield _start(
                group, infergate_cli, "engine-lora", tiny_model_dir,
                "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "256",
                "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                "--lora-modules", f"attn={adapters['attn']}",
                "--lora-modules", json.dumps({"name": "mlp", "path": str(adapters["mlp"]),
                                              "base_model_name": MODEL}),
            )  # fmt: skip
    finally:
        os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)


def complete(client: openai.OpenAI, model: str, max_tokens: int = 12) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                    temperature=0)  # fmt: skip
    return out.choices[0].text


def test_adapters_are_listed_with_their_parent(lora_server: Server) -> None:
    models = {m.id: m for m in lora_server.client().models.list().data}
    assert set(models) == {MODEL, "attn", "mlp"}
    assert models["attn"].parent == MODEL and models["mlp"].parent == MODEL  # type: ignore[attr-defined]
    assert models[MODEL].parent is None  # type: ignore[attr-defined]


def test_requests_run_with_their_adapter(lora_server: Server) -> None:
    client = lora_server.client()
    base, attn, mlp = (complete(client, m) for m in (MODEL, "attn", "mlp"))
    assert len({base, attn, mlp}) == 3, "each adapter must change the greedy output"
    assert complete(client, "attn") == attn  # deterministic, and slots are reused
    chat = client.chat.completions.create(
        model="mlp", messages=[{"role": "user", "content": "Hello"}], max_tokens=5
    )
    assert chat.model == "mlp"


def test_unknown_adapter_is_a_404_in_openai_shape(lora_server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        complete(lora_server.client(), "no-such-adapter")
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "model"
    assert "no-such-adapter" in body["message"]


def test_runtime_load_and_unload(lora_server: Server, adapters: dict[str, Path]) -> None:
    client, http = lora_server.client(), lora_server.http()
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])}
    )
    assert r.status_code == 200, r.text
    late = complete(client, "late")
    assert late != complete(client, MODEL)
    # A third adapter with two slots: the LRU one is swapped out and back transparently.
    assert complete(client, "attn") != late
    assert complete(client, "late") == late
    r = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])}
    )
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "late")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(
    lora_server: Server, adapters: dict[str, Path], tmp_path: Path
) -> None:
    http = lora_server.http()

    def load(name: str, path: object) -> httpx.Response:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    r = load("gone", str(tmp_path / "nowhere"))
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    r = load("wide", str(adapters["wide"]))  # rank 16 > --max-lora-rank 8
    assert r.status_code == 400
    assert (
        "rank 16" in r.json()["error"]["message"]
        and "max-lora-rank" in r.json()["error"]["message"]
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        (adapters["attn"] / "adapter_config.json").read_text()
    )
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 64)
    r = load("corrupt", str(corrupt))
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"]
    r = load("", str(corrupt))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = http.post("/v1/load_lora_adapter", content=b"{not json")
    assert r.status_code == 400
    models = {m.id for m in lora_server.client().models.list().data}
    assert not models & {"gone", "wide", "corrupt"}
    assert complete(lora_server.client(), "attn")  # still serving


def test_lora_requests_info_metric(lora_server: Server) -> None:
    text = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    # prometheus_client writes labels sorted, for vLLM as for us.
    assert line.startswith(
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    )
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:lora_requests_info"]  # fmt: skip
    assert len(samples) == 1 and samples[0].value > 1.7e9  # a Unix timestamp
