"""Multi-LoRA through the real Envoy and EPP (``infergate up --lora 4``): simulated
engines with 2 adapter slots each serve 4 adapters by name; the EPP's LoRA affinity
keeps an adapter's requests on the engine running it; an engine brings an adapter it
has never run into a slot on demand; an InferenceModelRewrite splits a public model name
over two adapters by weight and the rewritten name reaches the engine.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.envoy.bootstrap import UPSTREAM_HOST_HEADER
from infergate.stack.local import LocalStack, StackSpec
from tests.support.probes import scrape, wait_for

from .conftest import _STACKS

REWRITE_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: canary}
spec:
  rules:
  - matches: [{model: {value: support-bot}}]
    targets:
    - {modelRewrite: lora-0, weight: 80}
    - {modelRewrite: lora-1, weight: 20}
"""


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("lora-stack")
    objectives = workdir / "objectives.yaml"
    objectives.write_text(REWRITE_YAML)
    spec = StackSpec.on_free_ports(
        engines=2, model=tiny_model, served_model_name="tiny", simulate=True, lora=4,
        max_loras=2, objectives_file=objectives, workdir=workdir, start_timeout=180.0,
    )  # fmt: skip
    with LocalStack(spec) as running:
        _STACKS.append(running)
        try:
            yield running
        finally:
            _STACKS.remove(running)


def running_adapters(address: str) -> set[str]:
    for (name, labels), _ in scrape(f"http://{address}/metrics").items():
        if name == "vllm:lora_requests_info":
            value = dict(labels).get("running_lora_adapters", "")
            return {a for a in value.split(",") if a}
    raise AssertionError(f"{address} exports no vllm:lora_requests_info")


def complete(stack: LocalStack, model: str, max_tokens: int = 4) -> httpx.Response:
    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                   json={"model": model, "prompt": "Tell me a story", "max_tokens": max_tokens})  # fmt: skip
    assert r.status_code == 200, r.text
    return r


class LongRequest:
    """A streaming request kept running in the background (its adapter shows as running)."""

    def __init__(self, stack: LocalStack, model: str, max_tokens: int = 400) -> None:
        self.served_by: str | None = None
        self._ready = threading.Event()
        body = {"model": model, "prompt": "A long one", "max_tokens": max_tokens, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(stack.base_url, body))
        self._thread.start()
        assert self._ready.wait(30), "the long request never started streaming"

    def _run(self, url: str, body: dict[str, object]) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            self.served_by = r.headers.get(UPSTREAM_HOST_HEADER)
            self._ready.set()
            for _ in r.iter_lines():
                pass

    def join(self) -> None:
        self._thread.join(120)


def test_models_list_the_adapters(lora_stack: LocalStack) -> None:
    for url in lora_stack.engine_urls:
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        cards = {m["id"]: m["parent"] for m in data}
        assert cards == {"tiny": None, **{f"lora-{i}": "tiny" for i in range(4)}}


def test_adapter_requests_stick_to_the_engine_running_it(lora_stack: LocalStack) -> None:
    long = LongRequest(lora_stack, "lora-2")
    assert long.served_by in lora_stack.engine_addresses
    wait_for(lambda: "lora-2" in running_adapters(long.served_by or ""), 10,
             "lora-2 running on its engine")  # fmt: skip
    try:
        served = Counter(complete(lora_stack, "lora-2").headers[UPSTREAM_HOST_HEADER]
                         for _ in range(8))  # fmt: skip
    finally:
        long.join()
    assert served == {long.served_by: 8}


def test_an_engine_loads_an_adapter_on_demand(lora_stack: LocalStack) -> None:
    before = {a: running_adapters(a) for a in lora_stack.engine_addresses}
    assert not any("lora-3" in s for s in before.values())
    long = LongRequest(lora_stack, "lora-3", max_tokens=300)
    try:
        assert long.served_by is not None
        wait_for(lambda: "lora-3" in running_adapters(long.served_by or ""), 10,
                 "lora-3 brought into a slot")  # fmt: skip
    finally:
        long.join()
    # Unknown adapters are refused by the engine with OpenAI's 404, through the gateway.
    r = httpx.post(f"{lora_stack.base_url}/v1/completions", timeout=30,
                   json={"model": "lora-99", "prompt": "x", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_model_rewrite_splits_a_public_name_over_adapters(lora_stack: LocalStack) -> None:
    models = Counter(complete(lora_stack, "support-bot").json()["model"] for _ in range(40))
    assert set(models) == {"lora-0", "lora-1"}, models
    assert models["lora-0"] > models["lora-1"]


@pytest.fixture(scope="module")
def real_lora_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[LocalStack]:
    """One real (CPU, tiny model) engine serving 2 random PEFT adapters."""
    workdir = tmp_path_factory.mktemp("real-lora-stack")
    objectives = workdir / "objectives.yaml"
    objectives.write_text(REWRITE_YAML.replace("weight: 80", "weight: 0").replace(
        "weight: 20", "weight: 1"))  # fmt: skip
    spec = StackSpec.on_free_ports(
        engines=1, model=tiny_model, served_model_name="tiny", simulate=False, lora=2,
        objectives_file=objectives, workdir=workdir, start_timeout=180.0,
        engine_args=["--device", "cpu", "--dtype", "float32"],
    )  # fmt: skip
    with LocalStack(spec) as running:
        _STACKS.append(running)
        try:
            yield running
        finally:
            _STACKS.remove(running)


def test_rewrite_reaches_a_real_engine_running_the_adapter_weights(
    real_lora_stack: LocalStack,
) -> None:
    def text(url: str, model: str) -> str:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    (engine,) = real_lora_stack.engine_urls
    direct = {m: text(engine, m) for m in ("tiny", "lora-0", "lora-1")}
    assert len(set(direct.values())) == 3, "each adapter's weights change the output"
    # support-bot → lora-1 (weight 1; lora-0 weight 0) through Envoy and the EPP.
    assert text(real_lora_stack.base_url, "support-bot") == direct["lora-1"]
    assert real_lora_stack.workdir is not None
    assert (real_lora_stack.workdir / "loras" / "lora-1" / "adapter_config.json").is_file()
