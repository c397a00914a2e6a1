"""The CRDs: well-formed, structural, and they accept/reject examples as a cluster would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.operator.crd_validation import CRDRegistry, ValidationFailed

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
VALID = sorted((CRDS / "examples" / "valid").glob("*.yaml"))
INVALID = sorted((CRDS / "examples" / "invalid").glob("*.yaml"))


def _crd_docs() -> list[dict[str, Any]]:
    """Our API's CRDs (the top-level files; crds/kopf/ holds kopf's peering CRDs)."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted(CRDS.glob("*.yaml"))]
    return [d for d in docs if d.get("kind") == "CustomResourceDefinition"]


def _expected_error(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <error>'"
    return first.removeprefix("# expect: ").strip()


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


def test_pool_defaults_match_gie(crd_registry: CRDRegistry) -> None:
    pool = yaml.safe_load((CRDS / "examples" / "valid" / "inferencepool.yaml").read_text())
    defaulted = crd_registry.validate(pool)
    ref = defaulted["spec"]["endpointPickerRef"]
    assert (ref["group"], ref["kind"], ref["failureMode"]) == ("", "Service", "FailClose")


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_examples_are_accepted(path: Path, crd_registry: CRDRegistry) -> None:
    crd_registry.validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected_with_the_expected_error(
    path: Path, crd_registry: CRDRegistry
) -> None:
    with pytest.raises(ValidationFailed) as caught:
        crd_registry.validate(yaml.safe_load(path.read_text()))
    assert _expected_error(path) in str(caught.value)


def test_cel_rules_are_checked_on_their_own(crd_registry: CRDRegistry) -> None:
    """Both GIE CEL rules fire independently of the JSON-schema part."""
    base = yaml.safe_load((CRDS / "examples" / "valid" / "inferencepool.yaml").read_text())
    base["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}, {"number": 8000}]
    del base["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(ValidationFailed) as caught:
        crd_registry.validate(base)
    assert len(caught.value.errors) == 2
