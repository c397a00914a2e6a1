"""The Kubernetes surface against a real API server: the chart with the real ``helm``,
``kubectl apply`` of the manifests, and the CRDs' schema and CEL rules enforced by
kube-apiserver itself (the ``cluster`` fixture: the control plane ``make controlplane``
built, or ``INFERGATE_TEST_KUBECONFIG``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.controlplane import Cluster

from .validation import VALUE_SETS, is_custom

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "infergate"
EXAMPLES = ROOT / "crds" / "examples"
CRD_NAMES = (
    "inferencepools.inference.networking.k8s.io",
    "inferenceobjectives.inference.networking.x-k8s.io",
    "inferencemodelrewrites.inference.networking.x-k8s.io",
)


def wait_for(probe: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    """Poll ``probe`` until it returns something truthy (a deadline, never a timing claim)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"ig-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _items(cluster: Cluster, kinds: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", kinds, "-n", namespace, "-l", selector, "-o", "json")
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def test_helm_install_upgrade_uninstall(cluster: Cluster, namespace: str) -> None:
    release = "ig"
    selector = f"app.kubernetes.io/instance={release}"
    cluster.helm(
        "install", release, str(CHART), "-n", namespace,
        "--set", f"operator.watchNamespaces={{{namespace}}}",
    )  # fmt: skip
    for crd in CRD_NAMES:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")

    # The deployment and replicaset controllers make the operator's pod; kwok runs it.
    def operator_pod() -> dict[str, Any] | None:
        pods = _items(cluster, "pods", namespace, selector)
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        return running[0] if running else None

    pod = wait_for(operator_pod, "the operator's pod to be Running")
    assert pod["status"]["podIP"].startswith("127.")
    assert pod["spec"]["serviceAccountName"] == f"{release}-infergate"
    kinds = {o["kind"] for o in _items(cluster, "all,sa,role,rolebinding", namespace, selector)}
    assert {"Deployment", "ReplicaSet", "Pod", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    # Scoped to one namespace: no cluster-wide grant at all.
    assert cluster.get("clusterrole", f"{release}-infergate") is None

    cluster.helm(
        "upgrade", release, str(CHART), "-n", namespace, "--reuse-values",
        "--set", "epp.replicas=3", "--set", "operator.resyncSeconds=5",
    )  # fmt: skip
    deployment = cluster.get("deployment", f"{release}-infergate", namespace)
    assert deployment is not None
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
    assert env["INFERGATE_EPP_REPLICAS"] == "3"
    assert env["INFERGATE_RESYNC_SECONDS"] == "5"
    history = json.loads(cluster.helm("history", release, "-n", namespace, "-o", "json").stdout)
    assert [h["revision"] for h in history] == [1, 2]

    cluster.helm("uninstall", release, "-n", namespace, "--wait")
    # Everything the release made is gone, pods included (the garbage collector).
    wait_for(
        lambda: not _items(cluster, "all,sa,role,rolebinding,kopfpeerings", namespace, selector),
        "helm uninstall to leave nothing behind",
    )
    # CRDs stay: Helm never deletes what it installed from crds/ (documented behaviour).
    assert cluster.get("crd", CRD_NAMES[0]) is not None


def test_cluster_wide_install_binds_a_cluster_role(cluster: Cluster, namespace: str) -> None:
    release = f"cw{uuid.uuid4().hex[:4]}"
    cluster.helm("install", release, str(CHART), "-n", namespace, "--set", "operator.peering=")
    try:
        role = cluster.get("clusterrole", f"{release}-infergate")
        assert role is not None
        binding = cluster.get("clusterrolebinding", f"{release}-infergate")
        assert binding is not None and binding["subjects"][0]["namespace"] == namespace
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait")
    assert cluster.get("clusterrole", f"{release}-infergate") is None


def test_kubectl_apply_of_every_manifest(cluster: Cluster) -> None:
    """``kubectl apply -k`` of the operator install and the samples, as the docs say."""
    cluster.kubectl("apply", "--server-side", "-k", str(ROOT / "manifests" / "operator"))
    deployment = cluster.get("deployment", "infergate-operator", "infergate-system")
    assert deployment is not None
    namespace = f"ig-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl(
        "create", "secret", "generic", "tiny-engine-api-key", "-n", namespace,
        "--from-literal=api-key=not-a-real-key",
    )  # fmt: skip
    try:
        for folder in ("samples", "standalone-envoy"):
            rendered = cluster.kubectl("kustomize", str(ROOT / "manifests" / folder)).stdout
            out = cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=rendered.replace(
                "namespace: default", f"namespace: {namespace}"))  # fmt: skip
            assert "inferencepool.inference.networking.k8s.io/tiny" in out.stdout
        pool = cluster.get("inferencepool", "tiny", namespace)
        assert pool is not None
        assert pool["metadata"]["annotations"]["infergate.io/standalone-envoy"] == "true"
        # The engine's --api-key comes from that Secret, never from the manifest.
        engine = cluster.get("deployment", "tiny-engine", namespace)
        assert engine is not None
        (container,) = engine["spec"]["template"]["spec"]["containers"]
        (key,) = [e for e in container["env"] if e["name"] == "INFERGATE_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"] == {"name": "tiny-engine-api-key", "key": "api-key"}
        assert not any("--api-key" in a for a in container["args"])
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        # Everything but the CRDs, which the other tests of the session share.
        rendered = cluster.kubectl("kustomize", str(ROOT / "manifests" / "operator")).stdout
        kept = [d for d in rendered.split("\n---\n") if "kind: CustomResourceDefinition" not in d]
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                        stdin="\n---\n".join(kept), check=False)  # fmt: skip


def _expectation(path: Path) -> str:
    """The API server's message for an invalid example (its ``# api-server:`` line)."""
    for line in path.read_text().splitlines():
        if line.startswith("# api-server: "):
            return line.removeprefix("# api-server: ").strip()
    raise AssertionError(f"{path.name} needs a '# api-server: <message>' line")


@pytest.mark.parametrize(
    "path", sorted((EXAMPLES / "invalid").glob("*.yaml")), ids=lambda p: p.stem
)
def test_api_server_rejects_invalid_examples(
    cluster: Cluster, crds_installed: None, path: Path
) -> None:
    result = cluster.kubectl(
        "apply", "--dry-run=server", "-n", "default", "-f", str(path), check=False
    )
    assert result.returncode != 0, f"{path.name} was accepted:\n{result.stdout}"
    assert _expectation(path) in result.stderr, result.stderr


@pytest.mark.parametrize("path", sorted((EXAMPLES / "valid").glob("*.yaml")), ids=lambda p: p.stem)
def test_api_server_accepts_valid_examples(
    cluster: Cluster, crds_installed: None, path: Path
) -> None:
    cluster.kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(path))


@pytest.fixture(scope="module")
def crds_installed(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-k", str(ROOT / "crds"))
    # The chart's GatewayClass and sample HTTPRoute are checked by the API server too.
    cluster.kubectl("apply", "--server-side", "-k", str(ROOT / "crds" / "gateway-api"))
    for crd in CRD_NAMES:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


def _dry_run(cluster: Cluster, obj: dict[str, Any], namespace: str = "default") -> Any:
    """``kubectl apply --dry-run=server`` of one object: the API server's verdict."""
    return cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-",
        stdin=json.dumps(obj), check=False,
    )  # fmt: skip


def test_api_server_applies_gies_pool_defaults(cluster: Cluster, crds_installed: None) -> None:
    pool = yaml.safe_load((EXAMPLES / "valid" / "inferencepool.yaml").read_text())
    result = _dry_run(cluster, pool)
    assert result.returncode == 0, result.stderr
    ref = json.loads(result.stdout)["spec"]["endpointPickerRef"]
    assert (ref["group"], ref["kind"], ref["failureMode"]) == ("", "Service", "FailClose")


def test_api_server_runs_both_cel_rules_on_their_own(
    cluster: Cluster, crds_installed: None
) -> None:
    """Duplicate target ports and a Service picker without a port: two separate errors."""
    pool = yaml.safe_load((EXAMPLES / "valid" / "inferencepool.yaml").read_text())
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}, {"number": 8000}]
    del pool["spec"]["endpointPickerRef"]["port"]
    result = _dry_run(cluster, pool)
    assert result.returncode != 0
    assert "port number must be unique" in result.stderr, result.stderr
    assert "port is required when kind is 'Service'" in result.stderr, result.stderr


def _custom_objects(cluster: Cluster, values: dict[str, Any], namespace: str) -> list[Any]:
    """The chart's rendered objects of our CRDs' groups (and kopf's), by the real ``helm``."""
    values_file = cluster.workdir / f"values-{uuid.uuid4().hex[:6]}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    server = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    rendered = cluster.helm(
        "template", "ig", str(CHART), "-n", namespace, "-f", str(values_file),
        "--kube-version", server["gitVersion"],
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc and is_custom(doc)]


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_api_server_accepts_the_charts_custom_objects(
    cluster: Cluster, crds_installed: None, namespace: str, values: dict[str, Any]
) -> None:
    """Every InferencePool, InferenceObjective and peering the chart renders for a value
    set test_chart.py lints passes the CRDs' schema and CEL rules in kube-apiserver."""
    objects = _custom_objects(cluster, values, namespace)
    if values.get("sample", {}).get("enabled"):
        assert "InferencePool" in {o["kind"] for o in objects}, "the sample renders no pool"
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
        result = _dry_run(cluster, obj, namespace)
        assert result.returncode == 0, f"{obj['kind']} refused: {result.stderr}"


def test_api_server_accepts_the_status_the_operator_builds(
    cluster: Cluster, crds_installed: None, namespace: str
) -> None:
    """The operator's parents status, written through the status subresource, passes the
    CRD's status schema (parent conditions, observedGeneration) in kube-apiserver."""
    from infergate.operator import status as st

    pool = yaml.safe_load((EXAMPLES / "valid" / "inferencepool.yaml").read_text())
    pool["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(pool))
    parents = st.build_parents([], [st.true("Accepted", "Accepted", "ok")], 1, 2)
    cluster.kubectl(
        "patch", "inferencepool", pool["metadata"]["name"], "-n", namespace,
        "--subresource=status", "--type=merge", "-p", json.dumps({"status": {"parents": parents}}),
    )  # fmt: skip
    stored = cluster.get("inferencepool", pool["metadata"]["name"], namespace)
    assert stored is not None
    assert stored["status"]["parents"] == parents
