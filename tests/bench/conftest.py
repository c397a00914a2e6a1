"""Fixtures for these tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def infergate_cli() -> list[str]:
    """The `infergate` console script of this interpreter's environment, found next to
    ``sys.executable`` so tests work when the venv is not on PATH (e.g. `make test`);
    falls back to ``python -m infergate.cli``."""
    script = Path(sys.executable).parent / "infergate"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "infergate.cli"]
