"""The kustomize manifests: built (resources, bases, namespace, labels, patches) and
every object validated like the chart's."""

from __future__ import annotations

from pathlib import Path

import pytest

from .validation import build_kustomization, documents, validate_object

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
KUSTOMIZATIONS = sorted(p.parent for p in MANIFESTS.rglob("kustomization.yaml"))


def test_there_are_the_three_kustomizations() -> None:
    assert {p.name for p in KUSTOMIZATIONS} == {"operator", "samples", "standalone-envoy"}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_kustomization_builds_to_valid_unique_objects(directory: Path) -> None:
    objs = build_kustomization(directory)
    assert objs
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), "duplicate objects"
    for obj in objs:
        validate_object(obj)


def test_operator_install_matches_the_chart() -> None:
    objs = build_kustomization(MANIFESTS / "operator")
    kinds = {o["kind"] for o in objs}
    assert {
        "CustomResourceDefinition",
        "Namespace",
        "ClusterRole",
        "Deployment",
        "ClusterKopfPeering",
    } <= kinds
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    assert deployment["metadata"]["namespace"] == "infergate-system"
    bindings = [o for o in objs if o["kind"] == "ClusterRoleBinding"]
    assert {b["subjects"][0]["namespace"] for b in bindings} == {"infergate-system"}
    helm = pytest.importorskip("helm_python")
    rendered = helm.Chart.load(str(ROOT / "charts/infergate")).render({}, name="ig", namespace="ig")
    chart_roles = {
        o["metadata"]["name"].removeprefix("ig-infergate"): o["rules"]
        for o in documents(rendered["infergate/templates/rbac.yaml"])
        if o["kind"] == "ClusterRole"
    }
    roles = {
        o["metadata"]["name"].removeprefix("infergate-operator"): o["rules"]
        for o in objs
        if o["kind"] == "ClusterRole"
    }
    assert roles == chart_roles and set(roles) == {"", "-discovery", "-gateway"}


def test_samples_pool_selects_the_engine_and_standalone_overlay_switches_envoy_on() -> None:
    samples = {o["kind"]: o for o in build_kustomization(MANIFESTS / "samples")}
    pool, engine = samples["InferencePool"], samples["Deployment"]
    assert (
        pool["spec"]["selector"]["matchLabels"].items()
        <= engine["spec"]["template"]["metadata"]["labels"].items()
    )
    assert samples["InferenceObjective"]["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    assert "annotations" not in pool["metadata"]
    standalone = {o["kind"]: o for o in build_kustomization(MANIFESTS / "standalone-envoy")}
    assert standalone["InferencePool"]["metadata"]["annotations"] == {
        "infergate.io/standalone-envoy": "true"
    }
    assert standalone["InferencePool"]["spec"] == pool["spec"]
