"""Tests of the suite's own parts (not conformance tests: no report entry): the echo
backend, the pod runtime's rewrites, the report, and kind.sh's tool checks."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conformance.drivers.runtime import ECHO_SERVER, container_kind, redirect_ads
from conformance.report import FAILED, GIE_TESTS, PASSED, SKIPPED, build_report
from infergate.procs import ProcessGroup, free_port, tcp_ready
from tests.support import xds_harness
from tests.support.pods import container_env, expand
from tests.support.xds_harness import check_sse

KIND_SH = Path(__file__).resolve().parent / "kind.sh"


def test_echo_reports_identity_rank_and_body(processes: ProcessGroup) -> None:
    ports = [free_port(), free_port()]
    argv = [sys.executable, str(ECHO_SERVER), "--host", "127.0.0.1"]
    for port in ports:
        argv += ["--port", str(port)]
    env = dict(os.environ, POD_NAME="echo-7", NAMESPACE="ns-x", POD_IP="10.1.2.3")
    processes.start("echo", argv, env=env, ready=tcp_ready("127.0.0.1", ports[1]))

    def chunks() -> Iterator[bytes]:  # a streamed (chunked) OpenAI body
        yield b'{"model": "m-1", '
        yield b'"prompt": "hi"}'

    with httpx.Client() as client:
        reply = client.post(
            f"http://127.0.0.1:{ports[1]}/v1/completions?x=1",
            content=chunks(),
            headers={"content-type": "application/json", "x-test": "a"},
        )
        assert reply.status_code == 200
        body = reply.json()
        assert (body["pod"], body["namespace"], body["podIP"]) == ("echo-7", "ns-x", "10.1.2.3")
        assert body["httpPort"] == str(ports[1])
        assert (body["method"], body["path"], body["model"]) == (
            "POST",
            "/v1/completions?x=1",
            "m-1",
        )
        assert body["bodyBytes"] == len(b'{"model": "m-1", "prompt": "hi"}')
        assert body["headers"]["X-Test"] == ["a"]
        other = client.delete(
            f"http://127.0.0.1:{ports[0]}/anything",
            headers={"X-Echo-Set-Header": "x-conformance-test-served-endpoint:10.1.2.3:3000"},
        )
        assert other.status_code == 200 and other.json()["httpPort"] == str(ports[0])
        assert other.json()["model"] is None and other.json()["proto"] == "HTTP/1.1"
        # echo-basic's contract: the request names response headers to set
        assert other.headers["x-conformance-test-served-endpoint"] == "10.1.2.3:3000"


def test_echo_serves_h2c_with_prior_knowledge_and_refuses_http1(processes: ProcessGroup) -> None:
    """The h2c port (InferencePoolAppProtocol's backend) speaks HTTP/2 without TLS and
    says so in ``proto``; an HTTP/1.1 request there is refused, as echo-basic does."""
    http_port, h2c_port = free_port(), free_port()
    argv = [sys.executable, str(ECHO_SERVER), "--host", "127.0.0.1", "--pod-name", "echo-h2"]
    env = dict(os.environ, HTTP_PORT=str(http_port), H2C_PORT=str(h2c_port))
    processes.start("echo-h2c", argv, env=env, ready=tcp_ready("127.0.0.1", h2c_port))
    with httpx.Client(http1=False, http2=True) as h2c:
        for _ in range(2):  # two streams on one connection
            reply = h2c.post(
                f"http://127.0.0.1:{h2c_port}/v1/completions",
                json={"model": "m-2", "prompt": "x" * 100_000},
                headers={"X-Echo-Set-Header": "a:1,a:2"},
            )
            assert reply.http_version == "HTTP/2" and reply.status_code == 200
            body = reply.json()
            assert (body["proto"], body["pod"], body["model"]) == ("HTTP/2.0", "echo-h2", "m-2")
            assert body["httpPort"] == str(h2c_port) and body["path"] == "/v1/completions"
            assert reply.headers["a"] == "1,2"
    refused = httpx.post(f"http://127.0.0.1:{h2c_port}/", json={})
    assert refused.status_code == 400 and refused.text == "Expected h2c request"
    plain = httpx.get(f"http://127.0.0.1:{http_port}/")
    assert plain.status_code == 200 and plain.json()["proto"] == "HTTP/1.1"


def test_runtime_fills_env_and_args_as_the_kubelet_does() -> None:
    pod = {
        "metadata": {"name": "p-1", "namespace": "ns", "uid": "u"},
        "spec": {"serviceAccountName": "sa"},
        "status": {"podIP": "127.9.9.4"},
    }
    container = {
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "WHERE", "value": "$(POD_IP):80"},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ]
    }
    env = container_env(pod, container)
    assert env == {"POD_IP": "127.9.9.4", "WHERE": "127.9.9.4:80", "NS": "ns"}
    assert expand("--ip=$(POD_IP) $(UNSET) $$(POD_IP)", env) == "--ip=127.9.9.4 $(UNSET) $(POD_IP)"
    images = ("infergate/conformance-echo:dev", "ghcr.io/infergate/epp:conformance",
              "docker.io/envoyproxy/envoy:v1.33-latest", "infergate/sse-backend:dev",
              "busybox")  # fmt: skip
    assert [container_kind(i) for i in images] == ["echo", "epp", "envoy", "sse", None]


def test_sse_backend_process_names_itself_and_streams(processes: ProcessGroup) -> None:
    """What the runtime runs for an ``sse-backend`` image (the route-change benchmark's
    backends): ``/who`` names the backend, ``/sse`` streams complete events."""
    port = free_port()
    argv = [sys.executable, xds_harness.__file__, "--name", "b",
            "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    processes.start("sse", argv, ready=tcp_ready("127.0.0.1", port))
    with httpx.Client() as client:
        assert client.get(f"http://127.0.0.1:{port}/who").json() == {"backend": "b"}
        stream = client.get(f"http://127.0.0.1:{port}/sse?events=3&interval_ms=1")
    assert check_sse(stream.content, 3) == "b"


def test_runtime_points_only_the_ads_cluster_at_the_operator() -> None:
    """Listeners, routes and clusters stay the operator's: only the xDS Service's name
    (what cluster DNS resolves) becomes the operator process's address."""

    def sock(host: str, port: int) -> dict[str, Any]:
        return {"socket_address": {"address": host, "port_value": port}}

    def cluster(name: str, kind: str, host: str, port: int) -> dict[str, Any]:
        endpoint = {"endpoint": {"address": sock(host, port)}}
        return {"name": name, "type": kind, "dns_lookup_family": "V4_ONLY",
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint]}]}}  # fmt: skip

    bootstrap: dict[str, Any] = {
        "node": {"id": "ns/gw"},
        "admin": {"address": sock("127.9.9.4", 19000)},
        "dynamic_resources": {
            "ads_config": {"grpc_services": [{"envoy_grpc": {"cluster_name": "xds"}}]},
        },
        "static_resources": {
            "clusters": [
                cluster("xds", "STRICT_DNS", "infergate-xds.infergate-system.svc", 18000),
                cluster("other", "STRICT_DNS", "example.com", 1),
            ],
        },
    }
    out = redirect_ads(bootstrap, ("127.0.0.1", 41000))
    xds, other = out["static_resources"]["clusters"]
    assert xds["type"] == "STATIC" and "dns_lookup_family" not in xds
    endpoint = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"] == sock("127.0.0.1", 41000)
    assert other == bootstrap["static_resources"]["clusters"][1]
    assert {k: v for k, v in out.items() if k != "static_resources"} == {
        k: v for k, v in bootstrap.items() if k != "static_resources"
    }
    assert bootstrap["static_resources"]["clusters"][0]["type"] == "STRICT_DNS"  # untouched


def test_report_counts_every_gie_test_and_never_hides_failures() -> None:
    """GIE's format and wording; a GIE test that did not run counts as skipped, parts of
    one test merge (any failure fails it), infergate's own tests stay out."""
    outcomes = {name: [PASSED] for name in GIE_TESTS[2:]}
    outcomes |= {
        GIE_TESTS[2]: [PASSED, FAILED],
        GIE_TESTS[3]: [SKIPPED],
        "EppUnAvailableFailClose": [FAILED],
    }
    report = build_report(
        outcomes,
        root=Path(__file__).resolve().parents[1],
        date=datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    )
    assert report["kind"] == "ConformanceReport" and report["date"] == "2026-01-02T03:04:05Z"
    assert report["GatewayAPIInferenceExtensionVersion"] == "v1.6.0"
    assert report["mode"] == "external-epp"
    (profile,) = report["profiles"]
    assert profile["name"] == "Gateway"
    core = profile["core"]
    assert core["statistics"] == {"Failed": 1, "Passed": 10, "Skipped": 3}
    assert core["result"] == "failure"
    assert core["failedTests"] == [GIE_TESTS[2]]
    assert core["skippedTests"] == sorted([GIE_TESTS[0], GIE_TESTS[1], GIE_TESTS[3]])
    assert profile["summary"] == "Core tests failed with 1 test failures."
    passing = build_report({name: [PASSED] for name in GIE_TESTS}, root=Path("."))
    assert passing["profiles"][0]["core"] == {
        "result": "success",
        "statistics": {"Failed": 0, "Passed": 14, "Skipped": 0},
    }
    assert passing["profiles"][0]["summary"] == "Core tests succeeded."


def _kind_sh(
    tmp_path: Path, stubs: dict[str, str], extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run kind.sh with a PATH holding only ``stubs`` (tool → shell body) and the few
    coreutils the script needs before its checks, so installed tools cannot leak in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "mktemp"):
        real = shutil.which(tool)
        assert real is not None
        (bin_dir / tool).symlink_to(real)
    for tool, body in stubs.items():
        stub = bin_dir / tool
        stub.write_text(f"#!/bin/sh\n{body}\n")
        stub.chmod(0o755)
    return subprocess.run(
        ["/bin/bash", str(KIND_SH)],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path), **(extra_env or {})},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("present", "missing"),
    [((), "docker"), (("docker",), "kind"), (("docker", "kind"), "kubectl"),
     (("docker", "kind", "kubectl"), "helm")],
)  # fmt: skip
def test_kind_driver_names_the_missing_tool(
    tmp_path: Path, present: tuple[str, ...], missing: str
) -> None:
    """kind.sh stops before touching anything, naming the first tool it lacks."""
    result = _kind_sh(tmp_path, dict.fromkeys(present, "exit 0"))
    assert result.returncode == 1, result
    assert f"'{missing}' is not installed or not on PATH" in result.stderr
    assert "Creating kind cluster" not in result.stdout


def test_kind_driver_needs_a_running_docker_engine(tmp_path: Path) -> None:
    result = _kind_sh(tmp_path, {"docker": '[ "$1" = info ] && exit 1; exit 0'})
    assert result.returncode == 1, result
    assert "no Docker engine answers" in result.stderr


def test_kind_driver_steps_in_order_and_always_deletes_the_cluster(tmp_path: Path) -> None:
    """A dry run: every tool is a stand-in that records its arguments; pytest only
    collects. The script must make each call in order and delete the cluster at the end."""
    calls = tmp_path / "calls.log"
    record = f'echo "$(basename "$0") $*" >> {calls}; exit 0'
    stubs = {tool: record for tool in ("docker", "kind", "kubectl", "helm")}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("grep", "mkdir", "rm", "basename"):
        real = shutil.which(tool)
        assert real is not None
        (bin_dir / tool).symlink_to(real)
    result = _kind_sh(tmp_path, stubs, extra_env={"PYTEST_ARGS": "--collect-only -q"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = calls.read_text().splitlines()
    expected_order = [
        "kind create cluster --name infergate-conformance --image kindest/node:v1.33.1",
        "docker build -f docker/operator.Dockerfile -t ghcr.io/infergate/operator:conformance .",
        "docker build -f docker/epp.Dockerfile -t ghcr.io/infergate/epp:conformance .",
        "docker build -t infergate/conformance-echo:dev conformance/echo",
        "kind load docker-image infergate/conformance-echo:dev --name infergate-conformance",
        "helm install infergate charts/infergate",
        "kind delete cluster --name infergate-conformance",
    ]
    position = 0
    for wanted in expected_order:
        found = [i for i, line in enumerate(lines) if line.startswith(wanted)]
        assert found and found[-1] >= position, f"{wanted!r} missing or out of order in {lines}"
        position = found[-1]
    assert "==> Running the conformance suite (cluster driver)" in result.stdout
