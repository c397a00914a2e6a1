"""Operator reconcile cost: API requests and time per pool, first apply vs steady state.

Runs the real reconcile (the code `infergate operator` runs per pool) against the
in-process API-server emulator over real HTTP, for N pools with M ready pods each, and
prints per-reconcile latency and request counts. The emulator answers in microseconds,
so the figures are the operator's own cost (client, diffing, building), not a cluster's.

    python benchmarks/operator_reconcile.py [--pools 20] [--pods 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from infergate.operator.kube import Kube, new_api_client
from infergate.operator.reconcile import reconcile
from infergate.operator.settings import OperatorSettings
from infergate.testing.kube_emulator import serve_emulator, write_kubeconfig

ROOT = Path(__file__).resolve().parents[1]


async def main(pools: int, pods: int, rounds: int) -> None:
    template = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    async with serve_emulator([ROOT / "crds"]) as emu:
        os.environ["KUBECONFIG"] = str(
            write_kubeconfig(Path(tempfile.mkdtemp()) / "kc", str(emu.url))
        )
        kube = Kube(new_api_client())
        settings = OperatorSettings()
        names = [f"pool-{i}" for i in range(pools)]
        for i, name in enumerate(names):
            pool = copy.deepcopy(template)
            pool["metadata"]["name"] = name
            pool["spec"]["selector"]["matchLabels"] = {"app": name}
            pool["spec"]["endpointPickerRef"]["name"] = f"{name}-epp"
            await emu.create_object(pool)
            for j in range(pods):
                await emu.add_pod("default", f"{name}-{j}", {"app": name}, ip=f"10.{i}.0.{j}")

        async def timed_round() -> tuple[list[float], int, int]:
            latencies, before, writes = [], emu.request_count, len(emu.write_requests())
            for name in names:
                start = time.perf_counter()
                await asyncio.to_thread(reconcile, kube, "default", name, settings)
                latencies.append((time.perf_counter() - start) * 1000)
            return latencies, emu.request_count - before, len(emu.write_requests()) - writes

        first, first_requests, first_writes = await timed_round()
        steady: list[float] = []
        steady_requests = steady_writes = 0
        for _ in range(rounds):
            lat, req, wr = await timed_round()
            steady += lat
            steady_requests += req
            steady_writes += wr

    def row(label: str, lat: list[float], requests: float, writes: float) -> str:
        p50 = statistics.median(lat)
        p95 = sorted(lat)[max(0, int(len(lat) * 0.95) - 1)]
        return f"| {label} | {p50:.1f} | {p95:.1f} | {requests:.1f} | {writes:.1f} |"

    print(f"{pools} pools x {pods} ready pods, {rounds} steady rounds")
    print("| reconcile | p50 ms | p95 ms | API requests/pool | writes/pool |")
    print("|---|---:|---:|---:|---:|")
    print(
        row("first (apply 6 objects + status)", first, first_requests / pools, first_writes / pools)
    )
    print(
        row(
            "steady (nothing changed)",
            steady,
            steady_requests / (pools * rounds),
            steady_writes / (pools * rounds),
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", type=int, default=20)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.pools, args.pods, args.rounds))
