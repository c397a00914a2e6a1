"""Conformance suite wiring: the driver (``--conformance-driver controlplane|cluster``), the
Gateways' addresses, the logs of the driver's processes on failures, and the report in
GIE's format (``--conformance-report``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from conformance import topology as topo
from conformance.drivers.base import Driver
from conformance.report import FAILED, PASSED, SKIPPED, build_report, write_report

ROOT = Path(__file__).resolve().parents[1]
_DRIVER_KEY = pytest.StashKey[Driver]()
_OUTCOMES_KEY = pytest.StashKey[dict[str, list[str]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "InferencePool conformance suite")
    group.addoption(
        "--conformance-driver",
        choices=("controlplane", "cluster", "node"),
        default=os.environ.get("CONFORMANCE_DRIVER", "controlplane"),
        help="controlplane (default): the real kube-apiserver `make controlplane` builds, "
        "processes for pods; cluster: the cluster in $KUBECONFIG; node: the real node "
        "(kubelet, containerd; `sudo make conformance-node`), pods from images",
    )
    group.addoption(
        "--conformance-report",
        default=os.environ.get("CONFORMANCE_REPORT"),
        help="write the conformance report (GIE's format, Gateway profile) here",
    )
    group.addoption(
        "--gateway-class",
        default=os.environ.get("CONFORMANCE_GATEWAY_CLASS", topo.DEFAULT_GATEWAY_CLASS),
        help="the GatewayClass the suite's Gateways name (default: infergate)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_OUTCOMES_KEY] = {}


@pytest.fixture(scope="session")
def driver(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    """The session's driver; its processes are shared by every test."""
    kind = request.config.getoption("--conformance-driver")
    gateway_class = request.config.getoption("--gateway-class")
    made: Driver
    if kind == "controlplane":
        from conformance.drivers.controlplane import ControlPlaneDriver

        made = ControlPlaneDriver(
            tmp_path_factory.mktemp("conformance"), _cli(), _bin_dir(), gateway_class
        )
    elif kind == "node":
        from conformance.drivers.node import NodeDriver

        made = NodeDriver(tmp_path_factory.mktemp("conformance"), gateway_class=gateway_class)
    else:
        from conformance.drivers.cluster import ClusterDriver

        made = ClusterDriver(tmp_path_factory.mktemp("conformance"), gateway_class=gateway_class)
    request.config.stash[_DRIVER_KEY] = made
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="session")
def primary_address(driver: Driver) -> str:
    """Where conformance-primary answers (GIE: GetGatewayEndpoint)."""
    return driver.gateway_address(topo.PRIMARY_GATEWAY, topo.INFRA_NS)


@pytest.fixture(scope="session")
def secondary_address(driver: Driver) -> str:
    """Where conformance-secondary answers."""
    return driver.gateway_address(topo.SECONDARY_GATEWAY, topo.INFRA_NS)


def _bin_dir() -> Path:
    """The control-plane binaries; without them (and outside CI) the suite skips, as the
    ``cluster`` tier does: `make controlplane` builds them (needs Go)."""
    from tests.support.controlplane import ControlPlaneError, binaries_dir, missing_binaries

    try:
        directory = binaries_dir()
        missing = missing_binaries(directory)
    except ControlPlaneError as error:
        missing, reason = ["all"], str(error)
    else:
        reason = f"control-plane binaries missing in {directory}: {', '.join(missing)}"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(f"{reason}; run `make controlplane`")
    return directory


def _cli() -> list[str]:
    import shutil

    exe = shutil.which("infergate") or str(Path(sys.executable).parent / "infergate")
    if not Path(exe).exists():
        pytest.fail("`infergate` is not installed: run `make install` first")
    return [exe]


def _short_name(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("conformance")
    return str(marker.args[0]) if marker is not None and marker.args else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    made = item.config.stash.get(_DRIVER_KEY, None)
    if made is not None and report.failed:
        for name, tail in made.logs():
            report.sections.append((f"log of {name}", tail))
    short_name = _short_name(item)
    if short_name is not None:
        if _OUTCOMES_KEY not in item.config.stash:
            item.config.stash[_OUTCOMES_KEY] = {}
        outcomes = item.config.stash[_OUTCOMES_KEY].setdefault(short_name, [])
        if hasattr(report, "wasxfail"):
            outcomes.append(FAILED)
        elif report.when == "call" or report.outcome != "passed":
            outcomes.append(
                {"passed": PASSED, "failed": FAILED, "skipped": SKIPPED}[report.outcome]
            )
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--conformance-report")
    outcomes = session.config.stash.get(_OUTCOMES_KEY, {})
    if not path or not outcomes:
        return
    write_report(Path(path), build_report(outcomes, root=ROOT))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per GIE test and per infergate extra: the report's view of the run."""
    from conformance.report import EXTRA_TESTS, GIE_TESTS, merge

    outcomes = terminalreporter.config.stash.get(_OUTCOMES_KEY, {})
    if not outcomes:
        return
    results = merge(outcomes)
    terminalreporter.section("InferencePool conformance (GIE v1.6 Gateway profile)")
    for name in GIE_TESTS:
        terminalreporter.write_line(f"{results.get(name, 'Not run'):8} {name}")
    for name in EXTRA_TESTS:
        terminalreporter.write_line(f"{results.get(name, 'Not run'):8} {name} (infergate)")
