"""HA through kopf peering: a standby replica takes over when the active one leaves."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import yaml

from infergate.testing.kube_emulator import KubeEmulator, wait_for

ROOT = Path(__file__).resolve().parents[2]
POOL = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())


def peers(emu: KubeEmulator) -> dict[str, Any]:
    peering = emu.get_object("ClusterKopfPeering", None, "infergate") or {}
    return dict(peering.get("status") or {})


async def test_standby_replica_takes_over(emulator: KubeEmulator, start_operator: Any) -> None:
    await emulator.create_object(
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": "infergate"},
        }
    )
    active = await start_operator(
        "--peering", "infergate", "--priority", "100", standalone=False, name="active"
    )
    await wait_for(lambda: len(peers(emulator)) == 1, what="the active operator in the peering")
    standby = await start_operator(
        "--peering", "infergate", "--priority", "10", standalone=False, name="standby"
    )
    await wait_for(lambda: len(peers(emulator)) == 2, what="both operators in the peering")

    first = copy.deepcopy(POOL)
    await emulator.create_object(first)
    await wait_for(
        lambda: emulator.get_object("Deployment", "default", "qwen-pool-epp"), what="first EPP"
    )
    await asyncio.sleep(2.0)  # both have seen the pool by now; only the active one acts
    assert "reconciled default/qwen-pool" in active.log_tail(100_000)
    assert "reconciled" not in standby.log_tail(100_000)

    await asyncio.to_thread(active.stop)  # a clean exit leaves the peering at once
    await wait_for(lambda: len(peers(emulator)) == 1, what="the active operator to leave")
    second = copy.deepcopy(POOL)
    second["metadata"]["name"] = "second"
    second["spec"]["endpointPickerRef"]["name"] = "second-epp"
    await emulator.create_object(second)
    await wait_for(
        lambda: emulator.get_object("Deployment", "default", "second-epp"),
        timeout=60,
        what="the standby to take over",
    )
