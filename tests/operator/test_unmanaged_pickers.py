"""``--no-manage-endpoint-pickers``: the operator deploys nothing for a pool and keeps no
parent entry of its own (pools are Gateway backends only, with their users' EPPs — how
GIE's conformance suite runs; the suite itself checks it end to end)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from infergate.operator import constants as c
from infergate.operator.kube import Kube
from infergate.operator.reconcile import reconcile
from infergate.operator.settings import GatewaySettings, OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]
GATEWAY_ENTRY = {
    "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "ns", "name": "gw"},
    "controllerName": "infergate.io/gateway-controller",
    "conditions": [],
}  # fmt: skip


class FakeKube:
    """The calls one reconcile makes, answered from a dict of live objects."""

    def __init__(self, *objects: Obj) -> None:
        self.live = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objects}
        self.calls: list[str] = []

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        return copy.deepcopy(self.live.get((kind, name)))

    def list(
        self, kind: str, namespace: str | None, labels: dict[str, str] | None = None
    ) -> list[Obj]:
        return [copy.deepcopy(o) for (k, _), o in self.live.items() if k == kind]

    def apply(self, obj: Obj) -> Obj:
        self.calls.append(f"apply {obj['kind']}")
        return obj

    def delete(self, kind: str, namespace: str | None, name: str, uid: str | None = None) -> bool:
        self.calls.append(f"delete {kind} {name}")
        return self.live.pop((kind, name), None) is not None

    def patch_status(
        self, kind: str, namespace: str, name: str, status: Obj, resource_version: str = ""
    ) -> Obj:
        self.calls.append(f"status {kind} {name}")
        self.live[(kind, name)]["status"] = status
        return {}

    def event(self, involved: Obj, type_: str, reason: str, message: str) -> None:
        self.calls.append(f"event {reason}")


def _pool(**spec: Any) -> Obj:
    body: Obj = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="pool-uid", generation=1)
    body["spec"].update(spec)
    return body


@pytest.mark.parametrize("without_ref", [False, True], ids=["with a picker ref", "without one"])
def test_unmanaged_pool_gets_nothing_and_loses_the_operators_parent(without_ref: bool) -> None:
    pool = _pool()
    if without_ref:
        del pool["spec"]["endpointPickerRef"]
    operator_entry = {"parentRef": dict(c.OPERATOR_PARENT_REF), "controllerName": c.CONTROLLER_NAME}
    pool["status"] = {"parents": [operator_entry, GATEWAY_ENTRY]}
    kube = FakeKube(pool)
    settings = OperatorSettings(manage_endpoint_pickers=False)
    reconcile(cast(Kube, kube), "ns", pool["metadata"]["name"], settings)
    assert not [call for call in kube.calls if call.startswith("apply")]
    assert kube.live[("InferencePool", pool["metadata"]["name"])]["status"] == {
        "parents": [GATEWAY_ENTRY]
    }
    kube.calls.clear()  # a second pass has nothing to write
    reconcile(cast(Kube, kube), "ns", pool["metadata"]["name"], settings)
    assert kube.calls == []


def test_the_flag_and_the_chart_variable_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI exports its flags to the environment the pool handlers read settings from."""
    env = GatewaySettings(manage_endpoint_pickers=False).to_env()
    monkeypatch.setenv(
        "INFERGATE_MANAGE_ENDPOINT_PICKERS", env["INFERGATE_MANAGE_ENDPOINT_PICKERS"]
    )
    assert OperatorSettings.from_env().manage_endpoint_pickers is False
    monkeypatch.setenv("INFERGATE_MANAGE_ENDPOINT_PICKERS", "true")
    assert OperatorSettings.from_env().manage_endpoint_pickers is True
