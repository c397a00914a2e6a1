"""The CRDs: well-formed and structural. That they accept and reject the examples, apply
GIE's defaults and run both CEL rules is asserted against the real API server in
test_cluster.py (the ``cluster`` tier), not by a validator of our own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


def _crd_docs() -> list[dict[str, Any]]:
    """Our API's CRDs (the top-level files; crds/kopf/ holds kopf's peering CRDs)."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted(CRDS.glob("*.yaml"))]
    return [d for d in docs if d.get("kind") == "CustomResourceDefinition"]


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, schema)]
    for name, sub in (schema.get("properties") or {}).items():
        nodes += _walk(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            nodes += _walk(schema[key], f"{path}[{key}]")
    return nodes


def test_the_three_apis_are_defined() -> None:
    served = {
        (d["spec"]["group"], v["name"], d["spec"]["names"]["kind"])
        for d in _crd_docs()
        for v in d["spec"]["versions"]
    }
    assert served == {
        ("inference.networking.k8s.io", "v1", "InferencePool"),
        ("inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective"),
        ("inference.networking.x-k8s.io", "v1alpha2", "InferenceModelRewrite"),
    }


@pytest.mark.parametrize("doc", _crd_docs(), ids=lambda d: d["metadata"]["name"])
def test_crd_is_a_valid_apiextensions_object(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, "1.32", strict=True)
    assert doc["metadata"]["name"] == f"{doc['spec']['names']['plural']}.{doc['spec']['group']}"


@pytest.mark.parametrize("doc", _crd_docs(), ids=lambda d: d["metadata"]["name"])
def test_crd_schema_is_structural_with_status_and_printer_columns(doc: dict[str, Any]) -> None:
    for version in doc["spec"]["versions"]:
        assert version["subresources"] == {"status": {}}
        assert version["additionalPrinterColumns"], "kubectl get should show useful columns"
        for path, node in _walk(version["schema"]["openAPIV3Schema"]):
            # A structural schema gives every node a type (no x-kubernetes-int-or-string here).
            assert "type" in node, f"{doc['metadata']['name']}{path} has no type"
            if "default" in node and "enum" in node:
                assert node["default"] in node["enum"]
