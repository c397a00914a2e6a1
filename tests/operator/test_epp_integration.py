"""The operator's EPP Deployment, run for real: its container arguments and its config
start the actual `infergate epp` against the same API server, and the gRPC health
services its probes name report what the probes expect."""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path
from typing import Any

import yaml

from infergate.procs import ProcessGroup, free_port, tcp_ready
from infergate.testing.kube_emulator import KubeEmulator, wait_for

ROOT = Path(__file__).resolve().parents[2]
POOL = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())


def health(port: int, service: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError as error:
            return str(error.code())
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _rebind(args: list[str], config: Path, ports: dict[str, int]) -> list[str]:
    """The Deployment's args with the config path and ports made local."""
    out = list(args)
    for flag, value in [("--config-file", str(config))] + [(f, str(p)) for f, p in ports.items()]:
        out[out.index(flag) + 1] = value
    return [*out, "--host", "127.0.0.1"]


async def test_the_deployed_epp_starts_from_its_deployment_and_config(
    emulator: KubeEmulator,
    start_operator: Any,
    processes: ProcessGroup,
    kubeconfig: Path,
    infergate_cli: list[str],
    tmp_path: Path,
) -> None:
    await start_operator()
    await emulator.create_object(copy.deepcopy(POOL))
    deployment = await wait_for(
        lambda: emulator.get_object("Deployment", "default", "qwen-pool-epp"), what="EPP"
    )
    config_map = emulator.get_object("ConfigMap", "default", "qwen-pool-epp")
    assert config_map is not None
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    config = tmp_path / "config.yaml"
    config.write_text(config_map["data"]["config.yaml"])
    ports = {f: free_port() for f in ("--grpc-port", "--grpc-health-port", "--metrics-port")}
    argv = [*infergate_cli, *_rebind(container["args"], config, ports)]
    health_port = ports["--grpc-health-port"]

    await asyncio.to_thread(
        processes.start, "epp", argv, ready=tcp_ready("127.0.0.1", health_port), timeout=60,
        env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
    )  # fmt: skip
    liveness = container["livenessProbe"]["grpc"]["service"]
    readiness = container["readinessProbe"]["grpc"]["service"]
    assert await asyncio.to_thread(health, health_port, liveness) == "SERVING"
    assert (
        await asyncio.to_thread(health, health_port, readiness) == "NOT_SERVING"
    )  # no endpoints yet

    # A model-server pod the pool selects turns Ready → the EPP sees it through the API.
    await emulator.add_pod("default", "engine-0", {"app": "qwen-engine"}, ip="127.0.0.1")

    async def ready() -> bool:
        return await asyncio.to_thread(health, health_port, readiness) == "SERVING"

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not await ready():
        assert loop.time() < deadline, "the EPP never became ready"
        await asyncio.sleep(0.2)
