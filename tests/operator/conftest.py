"""Fixtures: the KMock-based API server and the operator as a real process against it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from infergate.operator.crd_validation import CRDRegistry
from infergate.procs import ManagedProcess, ProcessGroup, free_port, http_ready
from infergate.testing.kube_emulator import KubeEmulator, serve_emulator, write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


@pytest_asyncio.fixture
async def emulator() -> AsyncIterator[KubeEmulator]:
    async with serve_emulator([CRDS, CRDS / "kopf"]) as emu:
        yield emu


@pytest.fixture
def kubeconfig(emulator: KubeEmulator, tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", str(emulator.url))


StartOperator = Callable[..., Awaitable[ManagedProcess]]


@pytest.fixture
def start_operator(
    processes: ProcessGroup, kubeconfig: Path, infergate_cli: list[str]
) -> StartOperator:
    """Start ``infergate operator`` (standalone, liveness endpoint) and wait for liveness."""

    async def start(
        *extra: str, resync: float = 1.0, name: str = "operator", standalone: bool = True
    ) -> ManagedProcess:
        port = free_port()
        env = dict(
            os.environ,
            KUBECONFIG=str(kubeconfig),
            INFERGATE_RESYNC_SECONDS=str(resync),
            INFERGATE_EPP_IMAGE="registry.example/infergate-epp:test",
        )
        argv = [
            *infergate_cli,
            "operator",
            *(["--standalone"] if standalone else []),
            "--liveness",
            f"http://127.0.0.1:{port}/healthz",
            *extra,
        ]
        return await asyncio.to_thread(
            processes.start, name, argv, ready=http_ready(f"http://127.0.0.1:{port}/healthz"),
            timeout=60.0, env=env,
        )  # fmt: skip

    return start


@pytest.fixture(scope="session")
def crd_registry() -> CRDRegistry:
    return CRDRegistry.from_paths(CRDS)
