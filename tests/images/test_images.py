"""The images ``make images`` built (build/images/<name>, OCI layouts), checked and run.

For each image: the layout is a valid OCI image (every digest verified, here and by skopeo),
its config is what its Dockerfile's last stage declares, and its last layer holds only
infergate itself. Then it runs under runc as the chart's pods run it (its entrypoint and
user, read-only root, no capabilities): ``--help`` answers; the operator, with the chart's
ServiceAccount token mounted where the kubelet puts it, serves its liveness endpoint and
reconciles a pool on the real API server; the EPP answers gRPC health SERVING and serves
metrics; the engine makes the chart's tiny model and serves a completion; each stops on
SIGTERM within the pod's 30 s grace.

An image that was not built is skipped (``make images IMAGES=<name>`` builds it), unless it
is named in INFERGATE_IMAGES_REQUIRED (``make images`` sets it to what it built): then it
fails. Running needs root, umoci, runc and skopeo (Debian packages; tools/images/build.sh
installs them).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tarfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infergate.procs import ProcessGroup, free_port, http_ready
from tests.support.controlplane import Cluster

from .oci import (
    Image,
    Runtime,
    ca_pem_of,
    dockerfile_final_stage,
    pod_spec,
    read_layout,
    service_account_dir,
    skopeo_inspect,
    unpack,
)

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("INFERGATE_IMAGES_OUT") or ROOT / "build" / "images")
REQUIRED = set(os.environ.get("INFERGATE_IMAGES_REQUIRED", "").replace(",", " ").split())
NAMES = ["operator", "epp", "engine", "engine-cuda"]
COMPONENT = {"operator": "operator", "epp": "epp", "engine": "engine", "engine-cuda": "engine"}
# A pod's default terminationGracePeriodSeconds: the kubelet SIGKILLs after it.
GRACE = 30.0


def _unavailable(name: str) -> str | None:
    if os.geteuid() != 0:
        return "running an image needs root (umoci unpack, runc)"
    missing = [tool for tool in ("umoci", "runc", "skopeo") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (apt-get install {' '.join(missing)})"
    if not (OUT / name / "index.json").is_file():
        return f"image {name} not built: make images IMAGES={name}"
    return None


@dataclass
class Unpacked:
    name: str
    image: Image
    rootfs: Path
    spec: dict[str, Any]

    @property
    def entrypoint(self) -> list[str]:
        return list(self.image.config["config"]["Entrypoint"])


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    """runc with a state directory of its own; at the end, no container may be left."""
    work = tmp_path_factory.mktemp("runc")
    runtime = Runtime(state=work / "state", workdir=work / "bundles")
    yield runtime
    if runtime.state.exists():
        assert runtime.containers() == [], "a container outlived its test"


@pytest.fixture(scope="session")
def layouts() -> Callable[[str], Image]:
    """name -> the image's layout, verified once per session (skipped or failed if absent)."""
    done: dict[str, Image] = {}

    def get(name: str) -> Image:
        reason = _unavailable(name)
        if reason is not None:
            if name in REQUIRED:
                pytest.fail(f"{reason} (INFERGATE_IMAGES_REQUIRED names it)")
            pytest.skip(reason)
        if name not in done:
            done[name] = read_layout(OUT / name)
        return done[name]

    return get


@pytest.fixture(scope="session")
def images(
    layouts: Callable[[str], Image], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Unpacked]]:
    """name -> the image unpacked once per session; the unpacked root filesystems (the
    engines' are about 5 GB) are removed at the end."""
    done: dict[str, Unpacked] = {}
    bundles: list[Path] = []

    def get(name: str) -> Unpacked:
        image = layouts(name)
        if name not in done:
            bundle = tmp_path_factory.mktemp(f"image-{name}") / "bundle"
            bundles.append(bundle)
            spec = unpack(image, bundle)
            done[name] = Unpacked(name, image, bundle / "rootfs", spec)
        return done[name]

    yield get
    for bundle in bundles:
        shutil.rmtree(bundle, ignore_errors=True)


@pytest.mark.parametrize("name", NAMES)
def test_layout_is_an_oci_image_configured_as_its_dockerfile_says(
    layouts: Callable[[str], Image], images: Callable[[str], Unpacked], name: str
) -> None:
    image = layouts(name)  # read_layout checked every digest and size already
    images(name)  # and umoci unpacks it, verifying the digests on its own
    # skopeo (containers/image) reads the same image and the same config.
    digest, config = skopeo_inspect(image)
    assert digest == image.manifest_digest
    assert config == image.config

    declared = dockerfile_final_stage(ROOT / "docker" / f"{name}.Dockerfile")
    got = image.config["config"]
    assert got["Entrypoint"] == declared["entrypoint"]
    assert got["Cmd"] == declared["cmd"]
    assert got["User"] == declared["user"]
    assert got.get("WorkingDir", "") in (
        (declared["workdir"],) if declared["workdir"] else ("", "/")
    )
    assert sorted(got.get("ExposedPorts", {})) == sorted(declared["expose"])
    env = dict(item.split("=", 1) for item in got["Env"])
    for key, value in declared["env"].items():
        prefix = value.split("$", 1)[0]  # PATH=/opt/infergate/bin:$PATH
        assert env[key].startswith(prefix) if "$" in value else env[key] == value, key
    assert image.config["os"] == "linux" and image.config["architecture"] == "amd64"


@pytest.mark.parametrize("name", NAMES)
def test_layers_keep_infergate_apart_from_its_dependencies(
    layouts: Callable[[str], Image], name: str
) -> None:
    """Base, python3, dependencies, infergate: a commit changes only the last, small layer."""
    image = layouts(name)
    layers = image.manifest["layers"]
    assert len(layers) == 4, [layer["digest"] for layer in layers]
    last = image.layout / "blobs" / "sha256" / layers[-1]["digest"].split(":", 1)[1]
    with gzip.open(last) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        names = [member.name.lstrip("./") for member in tar]
    files = [n for n in names if n.startswith("opt/infergate/")]
    assert files and len(files) == len([n for n in names if n not in ("opt", "opt/infergate")])
    assert any(n.endswith("site-packages/infergate/cli.py") for n in files)
    assert "opt/infergate/bin/infergate" in files
    assert not any("/torch/" in n or "/kubernetes/" in n for n in files)
    assert image.layer_sizes[-1] < 8 << 20, "infergate's own layer is small"


def test_images_share_their_base_and_python_layers(layouts: Callable[[str], Image]) -> None:
    built = [n for n in NAMES if _unavailable(n) is None]
    if len(built) < 2:
        pytest.skip("needs two images built")
    bottoms = {n: [x["digest"] for x in layouts(n).manifest["layers"][:2]] for n in built}
    assert len({tuple(v) for v in bottoms.values()}) == 1, bottoms
    if "operator" in built and "epp" in built:  # the same dependencies stage, word for word
        assert (
            layouts("operator").manifest["layers"][2]["digest"]
            == layouts("epp").manifest["layers"][2]["digest"]
        )


@pytest.mark.parametrize("name", NAMES)
def test_entrypoint_answers_help(
    images: Callable[[str], Unpacked], runtime: Runtime, name: str
) -> None:
    image = images(name)
    started = time.monotonic()
    done = runtime.run(pod_spec(image.spec, image.rootfs, [*image.entrypoint, "--help"]))
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-4000:]
    assert "Usage: infergate" in done.stdout
    for command in ("operator", "epp", "engine"):
        assert command in done.stdout
    component = COMPONENT[name]
    done = runtime.run(pod_spec(image.spec, image.rootfs, [*image.entrypoint, component, "--help"]))
    assert done.returncode == 0, done.stdout[-4000:]
    assert f"Usage: infergate {component}" in done.stdout
    print(f"{name}: `infergate --help` in the container took {seconds:.1f}s")


@pytest.fixture
def chart(cluster: Cluster) -> Iterator[tuple[str, int]]:
    """The chart in a fresh namespace watching only it, its operator's liveness on a free
    port (the image runs on the host's network); yields (namespace, that port)."""
    namespace = f"ig-img-{uuid.uuid4().hex[:6]}"
    port = free_port()
    cluster.kubectl("create", "namespace", namespace)
    cluster.helm(
        "install", "ig", str(ROOT / "charts" / "infergate"), "-n", namespace,
        "--set", f"operator.watchNamespaces={{{namespace}}}",
        "--set", f"operator.livenessPort={port}",
    )  # fmt: skip
    try:
        yield namespace, port
    finally:
        cluster.helm("uninstall", "ig", "-n", namespace, check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _wait_for(probe: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)
    return value


@pytest.mark.cluster
def test_operator_image_runs_the_charts_container(
    images: Callable[[str], Unpacked],
    runtime: Runtime,
    processes: ProcessGroup,
    cluster: Cluster,
    chart: tuple[str, int],
    tmp_path: Path,
) -> None:
    """The chart's operator container (its args and env, from the installed manifest) in the
    image, with the chart's ServiceAccount token where the kubelet mounts it."""
    image = images("operator")
    namespace, port = chart
    manifest = cluster.helm("get", "manifest", "ig", "-n", namespace).stdout
    deployment = next(
        doc for doc in yaml.safe_load_all(manifest)
        if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == "ig-infergate"
    )  # fmt: skip
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    env["POD_NAME"] = "ig-infergate-image-test"

    kubeconfig = json.loads(
        cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout
    )
    server = kubeconfig["clusters"][0]["cluster"]
    host, _, api_port = server["server"].removeprefix("https://").rpartition(":")
    env |= {"KUBERNETES_SERVICE_HOST": host.strip("[]"), "KUBERNETES_SERVICE_PORT": api_port}
    token = cluster.kubectl("create", "token", "ig-infergate", "-n", namespace).stdout.strip()
    secrets = service_account_dir(tmp_path / "sa", token, ca_pem_of(server), namespace)

    spec = pod_spec(
        image.spec, image.rootfs, [*image.entrypoint, *container["args"]], env=env,
        binds={"/var/run/secrets/kubernetes.io/serviceaccount": (secrets, False)},
    )  # fmt: skip
    healthz = f"http://127.0.0.1:{port}/healthz"
    running = runtime.start(processes, "operator-image", spec, http_ready(healthz), timeout=180)

    pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    name = pool["metadata"]["name"]
    _wait_for(lambda: cluster.get("deployment", f"{name}-epp", namespace), "the pool's EPP")
    stopped = running.terminate(GRACE)
    assert stopped is not None, f"still running {GRACE:.0f}s after SIGTERM"


def test_epp_image_serves_grpc_health_and_metrics(
    images: Callable[[str], Unpacked], runtime: Runtime, processes: ProcessGroup
) -> None:
    image = images("epp")
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    args = [
        *image.entrypoint, "epp", "--endpoint", f"127.0.0.1:{free_port()}", "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip

    def serving() -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0
                )
            except grpc.RpcError:
                return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    running = runtime.start(
        processes, "epp-image", pod_spec(image.spec, image.rootfs, args), serving, timeout=120
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        assert b"# TYPE" in reply.read()
    stopped = running.terminate(GRACE)
    assert stopped is not None, f"still running {GRACE:.0f}s after SIGTERM"


@pytest.mark.parametrize("name", ["engine", "engine-cuda"])
def test_engine_image_serves_the_charts_tiny_model(
    images: Callable[[str], Unpacked],
    runtime: Runtime,
    processes: ProcessGroup,
    tmp_path: Path,
    name: str,
) -> None:
    """The chart's CPU sample: its init container makes the tiny model into /models, the
    engine serves it (on CPU; the CUDA build of torch runs there too)."""
    image = images(name)
    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o777)
    make = runtime.run(
        pod_spec(
            image.spec, image.rootfs,
            [*image.entrypoint, "engine", "make-tiny-model", "/models/tiny", "--arch", "llama"],
            binds={"/models": (models, True)},
        )
    )  # fmt: skip
    assert make.returncode == 0, make.stdout[-4000:]

    port = free_port()
    args = [
        *image.entrypoint, "engine", "serve", "/models/tiny", "--device=cpu",
        "--host", "127.0.0.1", f"--port={port}", "--served-model-name=tiny",
    ]  # fmt: skip
    spec = pod_spec(image.spec, image.rootfs, args, binds={"/models": (models, False)})
    base = f"http://127.0.0.1:{port}"
    running = runtime.start(processes, f"{name}-image", spec, http_ready(f"{base}/health"), 300)
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        body = json.loads(reply.read())
    assert body["choices"] and body["usage"]["completion_tokens"] >= 1
    stopped = running.terminate(GRACE)
    assert stopped is not None, f"still running {GRACE:.0f}s after SIGTERM"
