"""The conformance report in GIE's format (Gateway API's ``ConformanceReport`` plus
``GatewayAPIInferenceExtensionVersion``), Gateway profile, from this suite's outcomes.

A test is named by the first argument of its ``conformance`` marker (GIE's ShortName,
e.g. ``GatewayFollowingEPPRouting``); pytest items sharing a name are one conformance
test: failed if any part failed (an expected failure counts as failed: a report never
hides a known gap), skipped if every part skipped, else passed.

The profile's statistics count GIE's tests only (:data:`GIE_TESTS`), every one of them:
a GIE test that did not run in this session (``-k``, ``-x``) is counted as skipped, so a
partial run can never read as ``success``. infergate's own tests (:data:`EXTRA_TESTS`)
are not GIE's and stay out of the report; the test summary lists them.
"""

from __future__ import annotations

import datetime
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

import infergate

#: The GIE release whose InferencePool API and Gateway-profile tests this suite runs.
GIE_VERSION = "v1.6.0"
#: The Gateway API release GIE v1.6.0's conformance builds against (its go.mod).
GATEWAY_API_VERSION = "v1.6.1"
PASSED, FAILED, SKIPPED = "Passed", "Failed", "Skipped"
#: GIE's ``mode``: how the implementation runs. Not ``default``: the suite deploys its own
#: Endpoint Pickers, as GIE's does, so the operator runs with
#: ``--no-manage-endpoint-pickers`` (chart: ``operator.manageEndpointPickers=false``).
MODE = "external-epp"
#: GIE v1.6.0's Gateway-profile conformance tests (conformance/tests/*.go ShortNames).
GIE_TESTS = (
    "EppUnAvailableFailOpen",
    "GatewayDestinationEndpointServed",
    "GatewayFollowingEPPRouting",
    "GatewayFollowingEPPRoutingWithDataParallelism",
    "GatewayWeightedAcrossTwoInferencePools",
    "HTTPRouteInvalidInferencePoolRef",
    "HTTPRouteMultipleGatewaysDifferentPools",
    "HTTPRouteMultipleRulesDifferentPools",
    "InferencePoolAccepted",
    "InferencePoolAppProtocol",
    "InferencePoolHTTPRoutePortValidation",
    "InferencePoolInvalidEPPService",
    "InferencePoolMissingEPPRef",
    "InferencePoolResolvedRefsCondition",
)
#: infergate's own conformance cases (no GIE counterpart).
EXTRA_TESTS = (
    "EppUnAvailableFailClose",
    "EPPReportsServedEndpoint",
    "GatewayEPPFallbackList",
    "InferencePoolInvalidPorts",
)


def _git_version(root: Path) -> str:
    """``<package version>+g<commit>``: a reproducible snapshot, as GIE's rules ask."""
    version = getattr(infergate, "__version__", "0.1.0")
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return str(version)
    return f"{version}+g{sha}"


def merge(outcomes: Mapping[str, list[str]]) -> dict[str, str]:
    """Per conformance test: the outcomes of its pytest items → one result."""
    merged = {}
    for name, parts in outcomes.items():
        if FAILED in parts:
            merged[name] = FAILED
        elif PASSED in parts:
            merged[name] = PASSED
        else:
            merged[name] = SKIPPED
    return merged


def core_result(outcomes: Mapping[str, list[str]]) -> dict[str, Any]:
    """The profile's ``core`` block over :data:`GIE_TESTS` (GIE's wording and keys)."""
    merged = merge(outcomes)
    results = {name: merged.get(name, SKIPPED) for name in GIE_TESTS}
    counts = {k: sum(1 for v in results.values() if v == k) for k in (PASSED, FAILED, SKIPPED)}
    core: dict[str, Any] = {}
    if counts[FAILED]:
        core["result"] = "failure"
        core["failedTests"] = sorted(k for k, v in results.items() if v == FAILED)
    elif counts[SKIPPED]:
        core["result"] = "partial"
    else:
        core["result"] = "success"
    if counts[SKIPPED]:
        core["skippedTests"] = sorted(k for k, v in results.items() if v == SKIPPED)
    core["statistics"] = {
        "Failed": counts[FAILED],
        "Passed": counts[PASSED],
        "Skipped": counts[SKIPPED],
    }
    return core


def _summary(core: Mapping[str, Any]) -> str:
    stats = core["statistics"]
    if core["result"] == "failure":
        return f"Core tests failed with {stats['Failed']} test failures."
    if core["result"] == "partial":
        return f"Core tests partially succeeded with {stats['Skipped']} test skips."
    return "Core tests succeeded."


def build_report(
    outcomes: Mapping[str, list[str]], *, root: Path, date: datetime.datetime | None = None
) -> dict[str, Any]:
    core = core_result(outcomes)
    stamp = (date or datetime.datetime.now(tz=datetime.UTC)).replace(microsecond=0)
    return {
        "GatewayAPIInferenceExtensionVersion": GIE_VERSION,
        "apiVersion": "gateway.networking.k8s.io/v1",
        "date": stamp.isoformat().replace("+00:00", "Z"),
        "gatewayAPIChannel": "standard",
        "gatewayAPIVersion": GATEWAY_API_VERSION,
        "implementation": {
            "contact": ["the infergate maintainers, through the project's issue tracker"],
            "organization": "infergate",
            "project": "infergate",
            "url": "infergate's source tree (README.md, conformance/README.md)",
            "version": _git_version(root),
        },
        "kind": "ConformanceReport",
        "mode": MODE,
        "profiles": [{"core": core, "name": "Gateway", "summary": _summary(core)}],
    }


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(report), sort_keys=False))
