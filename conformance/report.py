"""The conformance report, in GIE's shape (Gateway API's ConformanceReport + the
extension version), from the outcome of each conformance test.

A test is named by the first argument of its ``conformance`` marker (GIE's ShortName
where GIE has the test, e.g. ``GatewayFollowingEPPRouting``); pytest items sharing a
name are one conformance test: failed if any part failed (an expected failure counts as
failed: the report must not hide a known gap), skipped if every part skipped, else
passed.
"""

from __future__ import annotations

import datetime
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

import infergate

#: The GIE release whose API (InferencePool v1) and conformance tests this suite follows.
GIE_VERSION = "v1.5.0"
GATEWAY_API_VERSION = "v1.5.1"
PASSED, FAILED, SKIPPED = "Passed", "Failed", "Skipped"


def _git_version(root: Path) -> str:
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return infergate.__version__ if hasattr(infergate, "__version__") else "0.1.0"
    return f"{getattr(infergate, '__version__', '0.1.0')}+g{sha}"


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


def build_report(
    outcomes: Mapping[str, list[str]],
    *,
    mode: str,
    root: Path,
    gateway: str,
    date: datetime.datetime | None = None,
) -> dict[str, Any]:
    results = merge(outcomes)
    counts = {k: sum(1 for v in results.values() if v == k) for k in (PASSED, FAILED, SKIPPED)}
    if counts[FAILED]:
        result, summary = "failure", f"Core tests failed with {counts[FAILED]} test failures."
    elif counts[SKIPPED]:
        result = "partial"
        summary = f"Core tests partially succeeded with {counts[SKIPPED]} test skips."
    else:
        result, summary = "success", "Core tests succeeded."
    core: dict[str, Any] = {
        "result": result,
        "statistics": {
            "Failed": counts[FAILED],
            "Passed": counts[PASSED],
            "Skipped": counts[SKIPPED],
        },
    }
    if counts[SKIPPED]:
        core["skippedTests"] = sorted(k for k, v in results.items() if v == SKIPPED)
    if counts[FAILED]:
        core["failedTests"] = sorted(k for k, v in results.items() if v == FAILED)
    stamp = (date or datetime.datetime.now(tz=datetime.UTC)).replace(microsecond=0)
    return {
        "GatewayAPIInferenceExtensionVersion": GIE_VERSION,
        "apiVersion": "gateway.networking.k8s.io/v1",
        "date": stamp.isoformat().replace("+00:00", "Z"),
        "gatewayAPIChannel": "standard",
        "gatewayAPIVersion": GATEWAY_API_VERSION,
        "implementation": {
            "contact": ["https://github.com/infergate/infergate/issues"],
            "organization": "infergate",
            "project": "infergate",
            "url": "https://github.com/infergate/infergate",
            "version": _git_version(root),
        },
        "kind": "ConformanceReport",
        "mode": mode,
        "profiles": [
            {
                "core": core,
                "name": "Gateway",
                "summary": f"{summary} Gateway: {gateway}.",
            }
        ],
    }


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(report), sort_keys=False))
