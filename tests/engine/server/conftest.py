"""Real `infergate engine serve` processes on the tiny model, shared per session.

Starting a server costs seconds, so each kind (simulated, real model) is started once
and shared; tests that need an idle engine wait for it (see ``Server.wait_idle``). The
servers' logs are attached to the report of any failing test in this folder.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from infergate.engine.lora.tiny import make_tiny_lora
from prometheus_client.parser import text_string_to_metric_families

from infergate.procs import ManagedProcess, ProcessGroup, free_port, http_ready

API_KEY = "test-key"
MODEL = "tiny"
_SERVERS: list[ManagedProcess] = []


@dataclass
class Server:
    process: ManagedProcess
    port: int
    kv_events_port: int | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``name{label=value,...}`` → value (labels sorted)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out

    def max_model_len(self) -> int:
        models = httpx.get(
            f"{self.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
        ).json()
        return int(models["data"][0]["max_model_len"])

    def gauge(self, name: str) -> float:
        return self.metrics()[f"{name}{{model_name={MODEL}}}"]

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until nothing runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            busy = (
                self.gauge("vllm:num_requests_running"),
                self.gauge("vllm:num_requests_waiting"),
                self.gauge("vllm:kv_cache_usage_perc"),
            )
            if busy == (0, 0, 0):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy (running, waiting, usage) = {busy}")
            time.sleep(0.05)


def _start(
    group: ProcessGroup, argv_prefix: list[str], name: str, model_dir: Path, *extra: str
) -> Server:
    port, kv_port = free_port(), free_port()
    argv = [
        *argv_prefix, "engine", "serve", str(model_dir), "--port", str(port),
        "--served-model-name", MODEL, "--api-key", API_KEY, "--kv-events-port", str(kv_port),
        *extra,
    ]  # fmt: skip
    process = group.start(
        name, argv, ready=http_ready(f"http://127.0.0.1:{port}/health"), timeout=120
    )
    _SERVERS.append(process)
    return Server(process, port, kv_port)


@pytest.fixture(scope="session")
def sim_server(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[Server]:
    """Simulated engine: 128 blocks of 16 tokens, max_model_len 1024."""
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-sim", tiny_model_dir,
            "--simulate", "--num-gpu-blocks-override", "128", "--max-model-len", "1024",
            "--enable-dev-endpoints",
        )  # fmt: skip


@pytest.fixture(scope="session")
def real_server(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[Server]:
    """The real tiny model on CPU; a 8-token budget forces chunked prefill. Float32 KV
    too: the tests on it compare with transformers' float32 math."""
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-real", tiny_model_dir,
            "--device", "cpu", "--dtype", "float32", "--max-num-batched-tokens", "8",
            "--num-gpu-blocks-override", "256", "--kv-cache-dtype", "float32",
        )  # fmt: skip


@pytest.fixture(scope="session")
def responses_server(tiny_model_dir: Path, infergate_cli: list[str],
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # fmt: skip
    """The real tiny model with a LoRA adapter named ``adapter`` and the auto tool
    choice (hermes), for the Responses API tests."""
    lora = make_tiny_lora(tiny_model_dir, tmp_path_factory.mktemp("resp-lora") / "a", seed=1)
    with ProcessGroup() as group:
        yield _start(
            group, infergate_cli, "engine-responses", tiny_model_dir,
            "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "256",
            "--enable-lora", "--lora-modules", f"adapter={lora}",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        )  # fmt: skip


@pytest.fixture(params=["sim_server", "real_server"])
def any_server(request: pytest.FixtureRequest) -> Server:
    """The same API checks against the simulated and the real engine."""
    server: Server = request.getfixturevalue(request.param)
    return server


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for process in _SERVERS:
            report.sections.append((f"log of {process.name}", process.log_tail()))
    return report
