"""The EPP loads none of the engine's code or dependencies, and its image installs none.

The EPP image (docker/epp.Dockerfile) installs every runtime dependency except the
engine-only ones it lists; an EPP module that imported one of them, or the engine's own
code that pulls them in, would run here and fail at startup there. Each import check runs
in a fresh interpreter, so what other tests imported does not count. The list itself is
checked too: what the image installs, with everything that requires in turn (read from
the installed packages' metadata), must not bring an engine-only package back.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
        "infergate.epp.server.extproc",
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


def image_requirements() -> list[str]:
    """pyproject's dependencies as the Dockerfile filters them (same rule, same list)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    left_out = engine_only_packages()
    return [d for d in deps if re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0] not in left_out]


def required_by(requirements: list[str]) -> dict[str, str]:
    """Every distribution ``requirements`` pull in (extras and markers honoured), each
    with the one that required it first."""
    found: dict[str, str] = {}
    todo = [(Requirement(r), "pyproject.toml") for r in requirements]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        req, parent = todo.pop()
        key = (canonicalize_name(req.name), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        found.setdefault(key[0], parent)
        try:
            nested = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        envs = [{"extra": e} for e in (*req.extras, "")]
        for text in nested:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append((sub, key[0]))
    return found


def test_the_image_installs_no_engine_only_package_through_another() -> None:
    installed = required_by(image_requirements())
    assert "grpcio" in installed and "pydantic" in installed  # the walk saw the EPP's own
    brought = {
        name: installed[name]
        for name in map(canonicalize_name, engine_only_packages())
        if name in installed
    }
    assert not brought, f"the EPP image would install {brought} (package: required by)"


def test_no_epp_module_imports_a_package_the_image_leaves_out() -> None:
    """Lazy imports included (the precise-prefix scorer loads ``tokenizers`` only when
    given ``tokenizerPath``): each must come from a distribution the image installs."""
    owners = metadata.packages_distributions()
    left_out = {canonicalize_name(n) for n in engine_only_packages()}
    problems = []
    for path in sorted((ROOT / "epp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                dists = {canonicalize_name(d) for d in owners.get(top, [])}
                if dists & left_out:
                    rel = path.relative_to(ROOT)
                    problems.append(f"{rel}:{node.lineno} imports {top} ({sorted(dists)})")
    assert not problems, "\n".join(problems)
