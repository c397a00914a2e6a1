"""Validate rendered manifests: built-in kinds against the Kubernetes OpenAPI schemas
(kubernetes-validate), custom kinds against our CRDs (schema + CEL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from infergate.operator.crd_validation import CRDRegistry

KUBE_VERSION = "1.32"
ROOT = Path(__file__).resolve().parents[2]
CRD_DIRS = (ROOT / "crds", ROOT / "charts" / "infergate" / "crds")


def registry() -> CRDRegistry:
    return CRDRegistry.from_paths(*CRD_DIRS)


def check_httproute(obj: dict[str, Any]) -> None:
    """No Gateway API schema ships here: check the fields a pool route depends on."""
    assert obj["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert obj["spec"]["parentRefs"], "an HTTPRoute needs a parent Gateway"
    for rule in obj["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            assert (ref["group"], ref["kind"]) == ("inference.networking.k8s.io", "InferencePool")


def validate_object(obj: dict[str, Any], crds: CRDRegistry) -> str:
    """Validate one object; return how it was validated (for the test's own checks)."""
    import kubernetes_validate

    if crds.find(obj.get("apiVersion", ""), obj.get("kind", "")) is not None:
        crds.validate(obj)
        return "crd"
    if obj.get("kind") == "HTTPRoute":
        check_httproute(obj)
        return "httproute"
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    return "kubernetes"


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]
