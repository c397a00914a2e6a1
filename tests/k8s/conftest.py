"""Shared paths and validators for the Kubernetes-surface tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from infergate.operator.crd_validation import CRDRegistry

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


@pytest.fixture(scope="session")
def crd_registry() -> CRDRegistry:
    return CRDRegistry.from_paths(CRDS)
