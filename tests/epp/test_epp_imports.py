"""The EPP loads none of the engine's code or dependencies.

The EPP image (docker/epp.Dockerfile) installs every runtime dependency except the
engine-only ones it lists; an EPP module that imported one of them, or the engine's own
code that pulls them in, would run here and fail at startup there. Each check runs in a
fresh interpreter, so what other tests imported does not count.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Imports every module of the EPP (the server, the app, the CLI and every plugin), reports
# what got loaded, then mounts the `infergate` entry point the image runs and asks it for
# `epp --help`.
PROBE = """
import importlib, json, pkgutil, sys
import infergate.epp
modules = [m.name for m in pkgutil.walk_packages(infergate.epp.__path__, "infergate.epp.")]
for name in modules:
    importlib.import_module(name)
after_epp = sorted(sys.modules)
from typer.testing import CliRunner
import infergate.cli
result = CliRunner().invoke(infergate.cli.app, ["epp", "--help"])
print(json.dumps({"modules": modules, "after_epp": after_epp, "after_cli": sorted(sys.modules),
                  "help_exit": result.exit_code, "help": result.output}))
"""


def engine_only_packages() -> set[str]:
    """The distributions the EPP image leaves out, as the Dockerfile lists them."""
    text = (ROOT / "docker" / "epp.Dockerfile").read_text()
    found = re.search(r"engine_only\s*=\s*\{([^}]*)\}", text)
    assert found, "docker/epp.Dockerfile no longer names its engine_only set"
    names = set(re.findall(r"\"([A-Za-z0-9_.-]+)\"", found.group(1)))
    assert "torch" in names
    return names


@pytest.fixture(scope="module")
def report() -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def top_level(modules: object) -> set[str]:
    assert isinstance(modules, list)
    return {str(name).split(".")[0] for name in modules}


def test_the_epp_imports_no_engine_code_and_no_engine_dependency(
    report: dict[str, object],
) -> None:
    modules = report["modules"]
    assert isinstance(modules, list)
    # The walk really saw the EPP: the server, the app and the plugins.
    for name in (
        "infergate.epp.server",
        "infergate.epp.app",
        "infergate.epp.cli",
        "infergate.epp.scheduling.plugins.prefix",
        "infergate.epp.scheduling.plugins.precise_prefix",
    ):
        assert name in modules
    after_epp = report["after_epp"]
    assert isinstance(after_epp, list)
    assert not [m for m in after_epp if m.startswith("infergate.engine")]
    leaked = top_level(after_epp) & engine_only_packages()
    assert not leaked, f"importing the EPP loads {sorted(leaked)}, which its image lacks"


def test_the_image_entry_point_serves_epp_help_without_engine_dependencies(
    report: dict[str, object],
) -> None:
    assert report["help_exit"] == 0, report["help"]
    assert "Endpoint Picker" in str(report["help"])
    leaked = top_level(report["after_cli"]) & engine_only_packages()
    assert not leaked, f"`infergate epp --help` loads {sorted(leaked)}, which the image lacks"
