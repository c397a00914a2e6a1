"""Layer tables for one-way imports, shared by the engine's and the operator's layer tests.

A component (``engine/``, ``operator/``) is a stack of layers, lowest first. A module may
import modules of its own layer or of any layer below it, and outside the component only
what the table's lowest layer lists. Every import counts — module level, inside
functions, and under ``TYPE_CHECKING`` — because a type-only reference up the layers is
still a seam that goes the wrong way. A module of the component that the table does not
place is named, so a new module has to be placed. (tests/epp/test_layering.py holds the
EPP's table and reads imports with this module's :func:`imported`.)
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported(
    source: str, module: str, is_package: bool, known: Collection[str] = ()
) -> list[tuple[int, str]]:
    """(line, module) for every ``infergate`` import in ``source``, relative ones resolved.

    ``from pkg import name`` names the submodule ``pkg.name`` when ``known`` holds it,
    so ``from infergate.operator import constants`` counts as an import of ``constants``,
    not of the whole package.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return [(line, name) for line, name in found if name.split(".")[0] == "infergate"]


@dataclass(frozen=True)
class LayerTable:
    """One component's layers. Entries are module names or packages (a package covers its
    submodules; the longest listed prefix wins); an entry starting with ``=`` matches that
    module only (``=infergate``: the version, not every package under it)."""

    package: str  # "infergate.engine"
    folder: Path  # where the component's files are
    layers: tuple[tuple[str, tuple[str, ...]], ...]
    outside: str  # what the component may import from outside itself, for the message

    def layer_of(self, module: str) -> int | None:
        """The index of ``module``'s layer, None when unlisted."""
        best: tuple[int, int] | None = None  # (prefix length, layer)
        for rank, (_, entries) in enumerate(self.layers):
            for entry in entries:
                exact = entry.startswith("=")
                name = entry.lstrip("=")
                hit = module == name or (not exact and module.startswith(name + "."))
                if hit and (best is None or len(name) > best[0]):
                    best = (len(name), rank)
        return None if best is None else best[1]

    def layer_name(self, module: str) -> str | None:
        rank = self.layer_of(module)
        return None if rank is None else self.layers[rank][0]

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.rglob("*.py") if "__pycache__" not in p.parts)

    def module_name(self, path: Path) -> str:
        parts = list(path.relative_to(self.folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join([self.package, *parts])

    def modules(self) -> set[str]:
        return {self.module_name(p) for p in self.files()}

    def own(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def violations(self, source: str, module: str, is_package: bool = False) -> list[str]:
        """Why each ``infergate`` import of ``module`` breaks the table (empty: none does)."""
        mine = self.layer_of(module)
        if mine is None:
            return [f"{module} is in no layer of the table"]
        out = []
        for line, target in imported(source, module, is_package, self.modules()):
            rank = self.layer_of(target)
            if rank is None and self.own(target):
                out.append(f"{module}:{line} imports {target}, which is in no layer of the table")
            elif rank is None:
                out.append(f"{module}:{line} imports {target}; {self.outside}")
            elif rank > mine:
                out.append(
                    f"{module}:{line} ({self.layers[mine][0]}) imports {target} "
                    f"({self.layers[rank][0]}), a layer above it"
                )
        return out

    def all_violations(self) -> list[str]:
        """Every break in the component; its bare package marker is skipped when it
        imports nothing (a docstring has no layer)."""
        problems: list[str] = []
        for path in self.files():
            module = self.module_name(path)
            source = path.read_text()
            if module == self.package and not imported(source, module, True):
                continue
            problems += self.violations(source, module, path.name == "__init__.py")
        return problems

    def imports_of(self, module: str) -> list[tuple[int, str]]:
        """(line, target) for each ``infergate`` import of one of the component's modules."""
        relative = module.removeprefix(self.package).lstrip(".").replace(".", "/")
        path = self.folder / f"{relative}.py"
        is_package = not path.exists()
        if is_package:
            path = self.folder / relative / "__init__.py"
        return imported(path.read_text(), module, is_package, self.modules())
