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


def _relocate_ports(node: Any, mapping: dict[int, int]) -> Any:
    """The bootstrap with its fixed ports (listener, admin, EPP) moved to free ones."""
    if isinstance(node, dict):
        return {
            k: mapping.get(v, v) if k == "port_value" else _relocate_ports(v, mapping)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_relocate_ports(v, mapping) for v in node]
    return node


async def test_standalone_mode_serves_a_request_end_to_end(
    emulator: KubeEmulator,
    start_operator: Any,
    processes: ProcessGroup,
    kubeconfig: Path,
    infergate_cli: list[str],
    envoy_binary: Path,
    tmp_path: Path,
) -> None:
    """Envoy and the EPP exactly as the operator deploys them (args, EPP config, Envoy
    bootstrap), a simulated engine as the pool's pod: an OpenAI request goes through."""
    import httpx

    from infergate.stack.local import ensure_tiny_model

    model = await asyncio.to_thread(ensure_tiny_model)
    engine_port = free_port()
    engine = [*infergate_cli, "engine", "serve", str(model), "--host", "127.0.0.1",
              "--port", str(engine_port), "--served-model-name", "tiny", "--simulate"]  # fmt: skip
    from infergate.procs import http_ready

    await asyncio.to_thread(
        processes.start,
        "engine",
        engine,
        ready=http_ready(f"http://127.0.0.1:{engine_port}/health"),
        timeout=120,
    )

    pool = copy.deepcopy(POOL)
    pool["metadata"]["annotations"] = {"infergate.io/standalone-envoy": "true"}
    pool["spec"]["targetPorts"] = [{"number": engine_port}]
    await start_operator()
    await emulator.create_object(pool)
    deployment = await wait_for(
        lambda: emulator.get_object("Deployment", "default", "qwen-pool-epp"), what="EPP Deployment"
    )
    envoy_cm = emulator.get_object("ConfigMap", "default", "qwen-pool-epp-envoy")
    assert envoy_cm is not None  # applied before the Deployment
    epp_container, envoy_container = deployment["spec"]["template"]["spec"]["containers"]

    config = tmp_path / "epp.yaml"
    epp_cm = emulator.get_object("ConfigMap", "default", "qwen-pool-epp")
    assert epp_cm is not None
    config.write_text(epp_cm["data"]["config.yaml"])
    ports = {f: free_port() for f in ("--grpc-port", "--grpc-health-port", "--metrics-port")}
    await asyncio.to_thread(
        processes.start, "epp", [*infergate_cli, *_rebind(epp_container["args"], config, ports)],
        ready=tcp_ready("127.0.0.1", ports["--grpc-health-port"]), timeout=60,
        env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
    )  # fmt: skip
    await emulator.add_pod("default", "engine-0", {"app": "qwen-engine"}, ip="127.0.0.1")

    listen, admin = free_port(), free_port()
    bootstrap = _relocate_ports(
        yaml.safe_load(envoy_cm["data"]["envoy.yaml"]),
        {8081: listen, 19000: admin, 9002: ports["--grpc-port"]},
    )
    envoy_config = tmp_path / "envoy.yaml"
    envoy_config.write_text(yaml.safe_dump(bootstrap))
    args = list(envoy_container["args"])
    args[args.index("--config-path") + 1] = str(envoy_config)
    base_id = args.index("--base-id")
    del args[base_id : base_id + 2]  # several Envoys share this machine: no hot restart
    await asyncio.to_thread(
        processes.start, "envoy", [str(envoy_binary), *args, "--disable-hot-restart"],
        ready=tcp_ready("127.0.0.1", listen), timeout=60,
    )  # fmt: skip
    await wait_for(
        lambda: health(ports["--grpc-health-port"], "readiness") == "SERVING", what="EPP ready"
    )

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listen}", timeout=60) as client:
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 4}
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"] and body["usage"]["completion_tokens"] == 4
