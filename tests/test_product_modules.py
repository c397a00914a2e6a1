"""Every module of the installed package serves the product.

The package (``infergate/``, ``epp/``, ``engine/``, ``operator/``) is what a user installs;
harness that only tests, the conformance suite or benchmarks use lives in
``tests/support/``, ``conformance/`` or ``benchmarks/``. This test reads the package's
imports (``ast``, nothing is imported) and fails on a module that no other product module
imports and no product code names as a string (``python -m infergate.cli``, kopf's
``--module``): such a module is reachable only from outside the product.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Source folder → the package it installs as (setup.py's package_dir).
FOLDERS = {
    "infergate": "infergate",
    "epp": "infergate.epp",
    "engine": "infergate.engine",
    "operator": "infergate.operator",
}
#: Where the product starts: the console script ``infergate = infergate.cli:main``.
ENTRY_POINTS = {"infergate.cli"}
_NAMED = re.compile(r"\binfergate(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def product_modules() -> dict[str, Path]:
    """Dotted module name → source file, for every ``.py`` file of the package."""
    modules: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            relative = path.relative_to(base).with_suffix("")
            if folder == "infergate" and relative.parts[0] == "operator":
                continue  # the symlink to ../operator, read under its own folder
            parts = [p for p in relative.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def referenced(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules that ``path`` imports or names, resolved against ``known``."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path).split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(_NAMED.findall(node.value))
    # A module's import also loads its parent packages.
    closure: set[str] = set()
    for module in found:
        parts = module.split(".")
        closure.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return closure & known


def test_every_product_module_is_reached_from_the_product() -> None:
    modules = product_modules()
    known = set(modules)
    reached: set[str] = set()
    frontier = [m for m in ENTRY_POINTS if m in known]
    assert frontier, "the console script's module infergate.cli is missing"
    while frontier:
        name = frontier.pop()
        if name in reached:
            continue
        reached.add(name)
        frontier.extend(referenced(name, modules[name], known) - reached)
    unreached = sorted(known - reached)
    assert not unreached, (
        "modules no product code imports (move harness to tests/support/, conformance/ "
        f"or benchmarks/; delete dead code): {unreached}"
    )


def test_the_scan_sees_a_module_only_tests_import(tmp_path: Path) -> None:
    """The resolver above is what the layout test rests on: relative and absolute imports
    and ``-m`` strings count; a test's import does not."""
    product = tmp_path / "mod.py"
    product.write_text(
        "from . import sibling\nfrom .pkg.inner import thing\nimport infergate.other\n"
        "ARGV = ['-m', 'infergate.cli']\n"
    )
    known = {
        "infergate.x.sibling",
        "infergate.x.pkg.inner",
        "infergate.other",
        "infergate.cli",
        "infergate.x.only_tests",
    }
    found = referenced("infergate.x.mod", product, known | {"infergate.x.mod"})
    assert found == known - {"infergate.x.only_tests"}
