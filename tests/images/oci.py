"""Reading and running the OCI image layouts that ``make images`` writes (build/images/<name>).

What a registry and a container runtime would do with an image, without either: check the
layout against the OCI image spec (every blob's digest and size, every layer's diff_id), read
what the Dockerfile declares for the image's config, unpack the image with ``umoci`` (an
independent implementation that verifies digests too) and run it with ``runc`` the way the
chart's pods run: its own entrypoint, user and environment, read-only root, a tmpfs /tmp, no
capabilities; the host's network, so the test reaches its ports on 127.0.0.1.
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infergate.procs import ManagedProcess, ProcessGroup, ReadyCheck

ROOT = Path(__file__).resolve().parents[2]
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
CHUNK = 1 << 20


def _sha256_file(path: Path, gunzip: bool = False) -> str:
    digest = hashlib.sha256()
    opener = gzip.open if gunzip else open
    with opener(path, "rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


@dataclass
class Image:
    """One image of a layout, as its blobs say: checked, not trusted."""

    layout: Path
    tag: str
    manifest_digest: str
    manifest: dict[str, Any]
    config: dict[str, Any]
    #: compressed size of each layer, bottom first
    layer_sizes: list[int] = field(default_factory=list)


def _blob(layout: Path, descriptor: dict[str, Any]) -> Path:
    algorithm, _, hexdigest = descriptor["digest"].partition(":")
    assert algorithm == "sha256", descriptor
    path = layout / "blobs" / "sha256" / hexdigest
    assert path.is_file(), f"blob {descriptor['digest']} is missing"
    assert path.stat().st_size == descriptor["size"], f"blob {descriptor['digest']}: wrong size"
    assert _sha256_file(path) == descriptor["digest"], f"blob {descriptor['digest']}: wrong digest"
    return path


def read_layout(layout: Path) -> Image:
    """Check ``layout`` against the OCI image-layout and image-manifest specs, and read it.

    Every descriptor's size and sha256 digest is checked against its blob, and every layer's
    uncompressed digest against the config's ``rootfs.diff_ids``: what a registry or a
    runtime verifies on pull."""
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_text())
    assert index["schemaVersion"] == 2
    assert index.get("mediaType", INDEX) == INDEX
    assert len(index["manifests"]) == 1, "one image per layout"
    descriptor = index["manifests"][0]
    assert descriptor["mediaType"] == MANIFEST
    tag = descriptor["annotations"]["org.opencontainers.image.ref.name"]
    manifest = json.loads(_blob(layout, descriptor).read_text())
    assert manifest["schemaVersion"] == 2
    assert manifest.get("mediaType", MANIFEST) == MANIFEST
    assert manifest["config"]["mediaType"] == CONFIG
    config = json.loads(_blob(layout, manifest["config"]).read_text())
    for key in ("architecture", "os", "rootfs"):
        assert key in config, f"config lacks {key}"
    assert config["rootfs"]["type"] == "layers"
    layers = manifest["layers"]
    assert layers and len(layers) == len(config["rootfs"]["diff_ids"])
    for layer, diff_id in zip(layers, config["rootfs"]["diff_ids"], strict=True):
        assert layer["mediaType"] == LAYER_GZIP, layer["mediaType"]
        assert _sha256_file(_blob(layout, layer), gunzip=True) == diff_id, "layer diff_id"
    return Image(
        layout=layout, tag=tag, manifest_digest=descriptor["digest"], manifest=manifest,
        config=config, layer_sizes=[layer["size"] for layer in layers],
    )  # fmt: skip


def dockerfile_final_stage(path: Path) -> dict[str, Any]:
    """What a Dockerfile's last stage declares for the image config: ENTRYPOINT and CMD
    (exec form), USER, WORKDIR, EXPOSE and ENV; the test compares the built config with it."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    last = max(i for i, ln in enumerate(lines) if ln.upper().startswith("FROM "))
    declared: dict[str, Any] = {"env": {}, "expose": [], "user": None, "workdir": None}
    for line in lines[last + 1 :]:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword in ("ENTRYPOINT", "CMD"):
            declared[keyword.lower()] = json.loads(rest)
        elif keyword == "USER":
            declared["user"] = rest.strip()
        elif keyword == "WORKDIR":
            declared["workdir"] = rest.strip()
        elif keyword == "EXPOSE":
            declared["expose"] += [p if "/" in p else f"{p}/tcp" for p in rest.split()]
        elif keyword == "ENV":
            for pair in rest.split():
                key, _, value = pair.partition("=")
                declared["env"][key] = value
    return declared


def skopeo_inspect(image: Image) -> tuple[str, dict[str, Any]]:
    """The manifest digest and the config as ``skopeo`` (containers/image) reads them."""
    ref = f"oci:{image.layout}:{image.tag}"
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", ref], capture_output=True, check=True, timeout=120
    ).stdout
    config = subprocess.run(
        ["skopeo", "inspect", "--config", ref], capture_output=True, check=True, timeout=120
    ).stdout
    return f"sha256:{hashlib.sha256(raw).hexdigest()}", json.loads(config)


def unpack(image: Image, bundle: Path) -> dict[str, Any]:
    """``umoci unpack`` the image into ``bundle`` (rootfs/ and a runtime config.json made
    from the image config by umoci); returns that runtime config."""
    subprocess.run(
        ["umoci", "unpack", "--image", f"{image.layout}:{image.tag}", str(bundle)],
        capture_output=True, check=True, timeout=1800,
    )  # fmt: skip
    spec: dict[str, Any] = json.loads((bundle / "config.json").read_text())
    return spec


def pod_spec(
    base: dict[str, Any],
    rootfs: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    binds: dict[str, tuple[Path, bool]] | None = None,
) -> dict[str, Any]:
    """umoci's runtime config made to run like the chart's containers: ``args`` after the
    image's entrypoint, no capabilities, no new privileges, a read-only root filesystem, a
    tmpfs /tmp (the chart's emptyDir), ``binds`` (container path -> (host path, writable)),
    and the host's network namespace (a hostNetwork pod) so that 127.0.0.1 reaches it."""
    spec = copy.deepcopy(base)
    process = spec["process"]
    process["terminal"] = False
    process["args"] = args
    process["noNewPrivileges"] = True
    process["capabilities"] = {key: [] for key in process.get("capabilities", {})}
    names = set(env or {})
    process["env"] = [e for e in process["env"] if e.split("=", 1)[0] not in names]
    process["env"] += [f"{key}={value}" for key, value in (env or {}).items()]
    spec["root"] = {"path": str(rootfs), "readonly": True}
    spec["mounts"].append(
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777"]}
    )  # fmt: skip
    for destination, (source, writable) in (binds or {}).items():
        spec["mounts"].append(
            {"destination": destination, "type": "bind", "source": str(source),
             "options": ["rbind", "rw" if writable else "ro"]}
        )  # fmt: skip
    spec["linux"]["namespaces"] = [
        ns for ns in spec["linux"]["namespaces"] if ns["type"] != "network"
    ]
    return spec


@dataclass
class Runtime:
    """``runc`` with its state under ``state``; each run gets a bundle of its own."""

    state: Path
    workdir: Path

    def _bundle(self, spec: dict[str, Any]) -> tuple[str, Path]:
        container_id = f"infergate-test-{uuid.uuid4().hex[:10]}"
        bundle = self.workdir / container_id
        bundle.mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps(spec))
        return container_id, bundle

    def _runc(self, *args: str) -> list[str]:
        runc = shutil.which("runc")
        assert runc is not None
        return [runc, "--root", str(self.state), *args]

    def run(self, spec: dict[str, Any], timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """Run to completion; stdout and stderr together."""
        container_id, bundle = self._bundle(spec)
        try:
            return subprocess.run(
                self._runc("run", "--bundle", str(bundle), container_id),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
            )  # fmt: skip
        finally:
            self.delete(container_id)

    def start(
        self,
        processes: ProcessGroup,
        name: str,
        spec: dict[str, Any],
        ready: ReadyCheck,
        timeout: float,
    ) -> Container:
        """Start in the background (``runc run`` in the foreground of a managed process,
        whose log is the container's output) and wait until ``ready``."""
        container_id, bundle = self._bundle(spec)
        process = processes.start(
            name, self._runc("run", "--bundle", str(bundle), container_id),
            ready=ready, timeout=timeout,
        )  # fmt: skip
        return Container(self, container_id, process)

    def containers(self) -> list[str]:
        """The containers runc still knows of."""
        listed = subprocess.run(
            self._runc("list", "-q"), capture_output=True, text=True, check=True, timeout=60
        )
        return listed.stdout.split()

    def delete(self, container_id: str) -> None:
        subprocess.run(
            self._runc("delete", "--force", container_id), capture_output=True, timeout=60
        )


@dataclass
class Container:
    runtime: Runtime
    container_id: str
    process: ManagedProcess

    def terminate(self, grace: float = 30.0) -> float | None:
        """SIGTERM the container's first process, as the kubelet does on a pod's deletion;
        seconds until it exited, or None if it was still running after ``grace`` (then it
        is killed). Deleted either way."""
        started = time.monotonic()
        try:
            subprocess.run(
                self.runtime._runc("kill", self.container_id, "TERM"),
                capture_output=True, timeout=30,
            )  # fmt: skip
            popen = self.process.popen
            assert popen is not None
            try:
                popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                return None
            return time.monotonic() - started
        finally:
            self.runtime.delete(self.container_id)
            self.process.stop()


def service_account_dir(directory: Path, token: str, ca_pem: bytes, namespace: str) -> Path:
    """What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount, readable by
    the image's non-root user."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    for name, data in (
        ("token", token.encode()),
        ("ca.crt", ca_pem),
        ("namespace", namespace.encode()),
    ):
        path = directory / name
        path.write_bytes(data)
        path.chmod(0o644)
    return directory


def ca_pem_of(cluster_entry: dict[str, Any]) -> bytes:
    """The API server's CA from a kubeconfig ``cluster`` entry (inline or a file)."""
    if "certificate-authority-data" in cluster_entry:
        return base64.b64decode(cluster_entry["certificate-authority-data"])
    return Path(cluster_entry["certificate-authority"]).read_bytes()
