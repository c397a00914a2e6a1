"""``infergate epp`` takes GIE's and llm-d-router's EPP command lines (epp/gie_flags.py).

The argument lists are copied verbatim from the upstream manifests named above each; a
real ``infergate epp`` process started with GIE v1.6's conformance args must come up.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import typer.main
from grpc_health.v1 import health_pb2, health_pb2_grpc
from infergate.epp.gie_flags import GieArgsError, normalize
from infergate.epp.options import EppOptions

from infergate.cli import app
from infergate.options import build
from infergate.procs import ProcessGroup, free_port

# kubernetes-sigs/gateway-api-inference-extension v1.6.0,
# conformance/resources/base.yaml: the primary pool's EPP Deployment (lwepp:v1.6.0), args.
GIE_V1_6_CONFORMANCE_ARGS = [
    "--pool-name",
    "primary-inference-pool",
    "--pool-namespace",
    "inference-conformance-app-backend",
    "--zap-encoder",
    "json",
    "--grpc-port",
    "9002",
    "--grpc-health-port",
    "9003",
]
# kubernetes-sigs/gateway-api-inference-extension v1.5.0 (the same template is llm-d's
# llm-d-inference-scheduler config/charts/epplib/templates/_deployment.yaml): the args
# it renders for a vLLM pool with default values (release "vllm-pool" in "ns"; tracing
# on, metrics auth off, one extra `flags` entry).
GIE_CHART_ARGS = [
    "--pool-name", "vllm-pool", "--pool-namespace", "ns",
    "--pool-group", "inference.networking.k8s.io",
    "--zap-encoder", "json", "--config-file", "/config/default-plugins.yaml",
    "--v=3", "--tracing=true", "--metrics-endpoint-auth=false",
]  # fmt: skip
# The same chart with replicas: 2, and the flags it renders for trtllm-serve pools
# (quotes inside the argument, as the template writes them).
GIE_CHART_HA_ARGS = [
    "--pool-name", "vllm-pool", "--pool-namespace", "ns",
    "--pool-group", "inference.networking.k8s.io",
    "--lora-info-metric", "",
    "--zap-encoder", "json", "--config-file", "/config/default-plugins.yaml",
    "--ha-enable-leader-election", "--tracing=false",
]  # fmt: skip
# llm-d/llm-d-inference-scheduler deploy/components/inference-gateway/deployment.yaml
# (${...} substituted as its kustomize setup does).
LLM_D_ARGS = [
    "--pool-name", "pool", "--pool-namespace", "ns", "--v", "4",
    "--zap-encoder", "json", "--grpc-port", "9002", "--grpc-health-port", "9003",
    "--config-file", "/etc/epp/epp-config.yaml", "--metrics-endpoint-auth=false",
]  # fmt: skip


def parse(args: list[str]) -> EppOptions:
    """What ``infergate epp ARGS`` runs with: GIE's flags rewritten, then click's parse."""
    rewritten, _ = normalize(args)
    command: Any = typer.main.get_command(app).commands["epp"]  # type: ignore[attr-defined]
    context = command.make_context("epp", rewritten)
    return build(EppOptions, context.params)


def test_gie_conformance_args_parse() -> None:
    options = parse(GIE_V1_6_CONFORMANCE_ARGS)
    assert options.pool_name == "primary-inference-pool"
    assert options.pool_namespace == "inference-conformance-app-backend"
    assert (options.grpc_port, options.grpc_health_port) == (9002, 9003)
    _, notes = normalize(GIE_V1_6_CONFORMANCE_ARGS)
    assert notes == ["--zap-encoder: logging format only: accepted and ignored"]


@pytest.mark.parametrize("args", [GIE_CHART_ARGS, GIE_CHART_HA_ARGS, LLM_D_ARGS])
def test_chart_and_llm_d_args_parse(args: list[str]) -> None:
    options = parse(args)
    assert options.pool_name in ("vllm-pool", "pool")
    assert options.config_file is not None


@pytest.mark.parametrize(
    ("args", "level"),
    [(["--v", "4"], "debug"), (["-v=3"], "info"), (["-v5"], "debug"),
     (["--zap-log-level", "error"], "error"), (["--zap-log-level=panic"], "critical"),
     (["--zap-log-level", "4"], "debug")],
)  # fmt: skip
def test_verbosity_maps_to_log_level(args: list[str], level: str) -> None:
    assert parse(["--endpoint", "127.0.0.1:1", *args]).log_level == level


def test_go_booleans_and_quoted_values() -> None:
    base = ["--endpoint", "127.0.0.1:1"]
    assert parse([*base, "--secure-serving=false"]).secure_serving is False
    assert parse([*base, "--secure-serving=true"]).secure_serving is True
    assert parse([*base, "--secure-serving"]).secure_serving is True
    # The chart writes --flag="value" with the quotes inside the argument.
    assert normalize(['--total-queued-requests-metric="vllm:num_requests_waiting"'])[0] == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--metrics-endpoint-auth=true"], "--metrics-endpoint-auth"),
        (["--metrics-endpoint-auth"], "--metrics-endpoint-auth"),
        (["--endpoint-selector", "app=vllm"], "--endpoint-selector"),
        (["--endpoint-target-ports", "8000"], "--endpoint-target-ports"),
        (["--disable-endpoint-subset-filter"], "--disable-endpoint-subset-filter"),
        (["--pool-group", "inference.networking.x-k8s.io"], "--pool-group"),
        (['--total-queued-requests-metric="sglang:num_queue_reqs"'], "engine-type=sglang"),
        (["--model-server-metrics-scheme", "https"], "--model-server-metrics-scheme"),
        (["--enable-cert-reload"], "--enable-cert-reload"),
        (["--tracing=maybe"], "--tracing"),
        (["--zap-encoder"], "--zap-encoder needs a value"),
    ],
)
def test_flags_infergate_cannot_honour_are_refused(args: list[str], named: str) -> None:
    with pytest.raises(GieArgsError, match=named):
        normalize(args)


def test_refusal_is_a_usage_error_naming_the_flag(infergate_cli: list[str]) -> None:
    run = subprocess.run(
        [*infergate_cli, "epp", "--endpoint", "127.0.0.1:1", "--metrics-endpoint-auth=true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--metrics-endpoint-auth=true" in run.stderr


def _health_answers(port: int) -> bool:
    """The health port answers for the service GIE's probes name, "inference-extension"
    (NOT_SERVING counts: there is no engine behind it; an unknown service is an error)."""
    request = health_pb2.HealthCheckRequest(service="inference-extension")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health_pb2_grpc.HealthStub(channel).Check(request, timeout=1)
    except grpc.RpcError:
        return False
    return True


def test_real_epp_starts_with_gie_conformance_args(
    processes: ProcessGroup, infergate_cli: list[str], tmp_path: Path
) -> None:
    """GIE v1.6's conformance args verbatim, but for two values: the pool becomes a
    static endpoint (pool discovery needs a cluster) and the fixed ports free ones."""
    grpc_port, health_port = free_port(), free_port()
    args = list(GIE_V1_6_CONFORMANCE_ARGS)
    args[args.index("9002")] = str(grpc_port)
    args[args.index("9003")] = str(health_port)
    pool = args.index("--pool-name")
    args[pool : pool + 2] = ["--endpoint", f"127.0.0.1:{free_port()}"]
    log = tmp_path / "epp.log"
    argv = [*infergate_cli, "epp", *args, "--host", "127.0.0.1", "--metrics-port", str(free_port())]
    processes.start(
        "epp", argv, ready=lambda: _health_answers(health_port), timeout=60, log_path=log
    )
    assert "--zap-encoder: logging format only: accepted and ignored" in log.read_text()
