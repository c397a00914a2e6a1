"""One real stack per test module: simulated engines on the tiny model, the EPP, real Envoy.

Everything runs as real processes (``infergate.stack.local.LocalStack`` on free loopback
ports, the same code ``infergate up`` runs). The stack is module-scoped to keep the suite
fast; tests that disturb it (stop an engine, rewrite the endpoints file, kill the EPP)
restore it before they return. Logs of every child are attached to failing tests.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from infergate.stack.local import LocalStack, StackSpec, ensure_tiny_model

_STACKS: list[LocalStack] = []

SHEDDABLE_OBJECTIVE = "batch-sheddable"
OBJECTIVES_YAML = f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata:
  name: {SHEDDABLE_OBJECTIVE}
spec:
  priority: -1
  poolRef:
    name: local
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata:
  name: interactive
spec:
  priority: 10
  poolRef:
    name: local
"""
MAX_BODY_BYTES = 64 * 1024
# The default profile, but the picker names a fallback too: the EPP then answers
# "primary,fallback" and every test also covers Envoy using the first of the list.
EPP_CONFIG_YAML = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: saturation-filter
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
  parameters:
    maxNumOfEndpoints: 2
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: saturation-filter
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for stack in _STACKS:
            for process in stack.group:
                report.sections.append(
                    (f"log of {process.name} ({process.log_path})", process.log_tail(6000))
                )
    return report


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("stack")
    objectives = workdir / "objectives.yaml"
    objectives.write_text(OBJECTIVES_YAML)
    epp_config = workdir / "epp-config.yaml"
    epp_config.write_text(EPP_CONFIG_YAML)
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        objectives_file=objectives,
        epp_config_file=epp_config,
        # A small batch makes queues form quickly; a short staleness window keeps the
        # stale-metrics test short.
        engine_args=["--max-num-seqs", "2"],
        epp_args=[
            "--metrics-staleness-threshold",
            "1.0",
            "--metrics-timeout",
            "0.5",
            "--max-request-body-bytes",
            str(MAX_BODY_BYTES),
        ],
        workdir=workdir,
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        _STACKS.append(running)
        try:
            yield running
        finally:
            _STACKS.remove(running)
