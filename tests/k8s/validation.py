"""Validate rendered manifests offline: built-in kinds against the Kubernetes OpenAPI
schemas (kubernetes-validate). Custom kinds (our CRDs' and kopf's) are left to the real
API server: test_cluster.py applies them with ``--dry-run=server``, so the CRDs' schema
and CEL rules are enforced by kube-apiserver itself, not by a validator of ours."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KUBE_VERSION = "1.32"
ROOT = Path(__file__).resolve().parents[2]
CUSTOM_GROUPS = (
    "inference.networking.k8s.io",
    "inference.networking.x-k8s.io",
    "kopf.dev",
    "gateway.networking.k8s.io",
)

#: The chart's value sets: test_chart.py lints and validates each offline, and
#: test_cluster.py has the API server check the custom objects each renders.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "sample-cpu-standalone": {"sample": {"enabled": True}},
    "sample-cpu-gateway": {
        "sample": {
            "enabled": True,
            "standaloneEnvoy": False,
            "gateway": {"enabled": True, "namespace": "gw"},
        }
    },
    "sample-gpu": {"sample": {"enabled": True, "mode": "gpu", "failureMode": "FailOpen"}},
    "sample-pd": {"sample": {"enabled": True, "pd": {"enabled": True, "threshold": 512}}},
    "gateway-off": {"gateway": {"enabled": False}},
    "scoped-standalone-ha": {
        "operator": {"replicas": 2, "peering": "", "watchNamespaces": ["team-a", "team-b"]},
        "epp": {"replicas": 2, "extraArgs": ["--refresh-metrics-interval", "0.1"]},
    },
}


def is_custom(obj: dict[str, Any]) -> bool:
    """An object of our CRDs' groups or kopf's (validated by the API server, not here)."""
    return str(obj.get("apiVersion", "")).split("/")[0] in CUSTOM_GROUPS


def check_httproute(obj: dict[str, Any]) -> None:
    """No Gateway API schema ships here: check the fields a pool route depends on."""
    assert obj["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert obj["spec"]["parentRefs"], "an HTTPRoute needs a parent Gateway"
    for rule in obj["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            assert (ref["group"], ref["kind"]) == ("inference.networking.k8s.io", "InferencePool")


def validate_object(obj: dict[str, Any]) -> str:
    """Validate one built-in object; return how it was checked. A custom object only gets
    the shape every object needs here: the API server checks it in test_cluster.py."""
    import kubernetes_validate

    if obj.get("kind") == "HTTPRoute":
        check_httproute(obj)
        return "httproute"
    if is_custom(obj):
        assert obj.get("kind") and obj.get("metadata", {}).get("name"), obj
        return "crd"
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    return "kubernetes"


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "ClusterKopfPeering",
}  # fmt: skip
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "patches"}


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base.get(key), value)
        return out
    return patch


def _targets(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    wanted = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
    }
    return all(wanted[k] == v for k, v in target.items())


def build_kustomization(directory: Path) -> list[dict[str, Any]]:
    """The subset of `kustomize build` our manifests use: resources (files and bases),
    namespace, labels (pairs, no selectors) and patches (merge patches with a target).
    Anything else in a kustomization is an error here, so nothing is silently ignored."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZE_FIELDS
    assert not unknown, f"{directory}: kustomization fields this loader cannot check: {unknown}"
    objs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        objs += build_kustomization(path) if path.is_dir() else documents(path.read_text())
    for patch in spec.get("patches", []):
        body = yaml.safe_load((directory / patch["path"]).read_text())
        hits = [i for i, obj in enumerate(objs) if _targets(obj, patch["target"])]
        assert hits, f"{directory}: patch {patch['path']} matches nothing"
        for i in hits:
            objs[i] = _merge(objs[i], body)
    namespace = spec.get("namespace")
    for obj in objs:
        if namespace and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
        if namespace and obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace
        for group in spec.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
    return objs
