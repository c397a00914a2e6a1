"""The EPP's imports go one way: down the layers below, never back up.

As in llm-d-router's ``pkg/epp``: the data layer knows nothing of scheduling or request
control, the scheduler knows nothing of the Director, and the plugin interfaces sit below
both (``framework``), so a scheduling plugin can implement a request-control hook without
``scheduling`` importing ``requestcontrol``. docs/architecture.md draws the same table.

A module may import modules of its own layer or of any layer listed before it. Every
import counts — module level, inside functions, and under ``TYPE_CHECKING`` — because a
type-only reference up the layers is still a seam that goes the wrong way. Outside the
EPP, only :mod:`infergate.wire` (the formats shared with the engine and Envoy) may be
imported. A new EPP module must be placed in the table (the test names it otherwise).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layering import imported  # the walk the engine and operator tables use

EPP_DIR = Path(__file__).resolve().parents[2] / "epp"

#: Lowest first. Entries are module names or packages (a package covers its submodules).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("wire", ("infergate.wire", "infergate.options")),
    (
        "types",
        (
            "infergate.epp.types",
            "infergate.epp.prefill_cost",
            "infergate.epp.compact_json",
            "infergate.epp.heap",  # the process's malloc: set by app, trimmed by server
            "infergate.epp.native",  # the native modules' loader: one fallback policy
        ),
    ),
    ("observability", ("infergate.epp.observability", "infergate.epp.loop_histogram")),
    ("datalayer", ("infergate.epp.datalayer",)),
    ("flowcontrol", ("infergate.epp.flowcontrol",)),
    ("config", ("infergate.epp.config", "infergate.epp.options")),
    ("framework", ("infergate.epp.framework",)),
    (
        "scheduling internals",  # what the plugins use, knowing none of them
        (
            "infergate.epp.scheduling.prefix_index",  # the prefix index, Python and native
            "infergate.epp.scheduling._prefix_index",  # native (native/prefix_index)
        ),
    ),
    ("scheduling", ("infergate.epp.scheduling",)),
    ("requestcontrol", ("infergate.epp.requestcontrol",)),
    (
        "servers",
        (
            "infergate.epp.server",  # ext-proc and its stream phases, h2, EDS, TLS
            "infergate.epp._grpc_h2",  # native (native/grpc_h2): HTTP/2 for server.h2
        ),
    ),
    ("app", ("infergate.epp.app", "infergate.epp.workers")),
    ("cli", ("infergate.epp.cli", "infergate.epp.gie_flags")),
]


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer (the longest listed prefix), None when unlisted."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(EPP_DIR).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["infergate", "epp", *parts])


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Why each ``infergate`` import of ``module`` breaks the table (empty: none does)."""
    own = layer_of(module)
    if own is None:
        return [f"{module} is in no layer of LAYERS"]
    out = []
    for line, target in imported(source, module, is_package):
        rank = layer_of(target)
        if rank is None and (target + ".").startswith("infergate.epp."):
            out.append(f"{module}:{line} imports {target}, which is in no layer of LAYERS")
        elif rank is None:
            out.append(
                f"{module}:{line} imports {target}; outside itself the EPP imports only "
                "infergate.wire (and infergate.options, the CLI's option fields)"
            )
        elif rank > own:
            out.append(
                f"{module}:{line} ({LAYERS[own][0]}) imports {target} ({LAYERS[rank][0]}), "
                "a layer above it"
            )
    return out


def epp_modules() -> list[Path]:
    return sorted(p for p in EPP_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_epp_import_goes_down_the_layers() -> None:
    problems: list[str] = []
    for path in epp_modules():
        module = module_name(path)
        source = path.read_text()
        if module == "infergate.epp":  # the package marker: a docstring, nothing to place
            assert not imported(source, module, True)
            continue
        problems += violations(source, module, path.name == "__init__.py")
    assert not problems, "\n".join(problems)


def test_the_servers_reach_scheduling_only_through_the_director() -> None:
    """Header names come from infergate.wire, hook types from the framework: the ext-proc
    and EDS servers (the whole ``server`` package) import nothing of the scheduler or its
    plugins."""
    paths = sorted((EPP_DIR / "server").glob("*.py"))
    assert EPP_DIR / "server" / "stream.py" in paths
    for path in paths:
        module = module_name(path)
        is_package = path.name == "__init__.py"
        for line, target in imported(path.read_text(), module, is_package):
            assert not target.startswith("infergate.epp.scheduling"), f"{module}:{line} {target}"


def test_the_walk_sees_the_whole_epp() -> None:
    names = {module_name(p) for p in epp_modules()}
    assert {
        "infergate.epp.server.extproc",
        "infergate.epp.server.stream",
        "infergate.epp.requestcontrol.director",
        "infergate.epp.scheduling.scheduler",
        "infergate.epp.datalayer.discovery.kube",
        "infergate.epp.framework.requestcontrol",
    } <= names


@pytest.mark.parametrize(
    ("module", "source", "fragment"),
    [
        # The seams this test was written for: each one climbed before.
        (
            "infergate.epp.datalayer.discovery.kube",
            "from infergate.epp.requestcontrol.objectives import ObjectiveStore",
            "(datalayer) imports infergate.epp.requestcontrol.objectives (requestcontrol)",
        ),
        (
            "infergate.epp.types",
            "from infergate.epp.datalayer.prefill_cost import PrefillCost",
            "(types) imports infergate.epp.datalayer.prefill_cost (datalayer)",
        ),
        (
            "infergate.epp.scheduling.plugins.prefix",
            "from infergate.epp.requestcontrol.hooks import Hooks",
            "(scheduling) imports infergate.epp.requestcontrol.hooks (requestcontrol)",
        ),
        (
            "infergate.epp.scheduling.prefix_index",
            "from infergate.epp.scheduling.plugins.prefix import CHARS_PER_TOKEN",
            "(scheduling internals) imports infergate.epp.scheduling.plugins.prefix (scheduling)",
        ),
        (
            "infergate.epp.server.extproc",
            "from infergate.epp.app import Epp",
            "(servers) imports infergate.epp.app (app)",
        ),
        (
            "infergate.epp.observability",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from infergate.epp.scheduling.plugins.base import Plugin\n",
            "(observability) imports infergate.epp.scheduling.plugins.base (scheduling)",
        ),
        (
            "infergate.epp.datalayer.completions",
            "def load():\n    from infergate.engine.completion_events import decode_batch\n",
            "imports infergate.engine.completion_events; outside itself the EPP imports only",
        ),
        (
            "infergate.epp.server.stream_route",
            "from infergate.envoy.names import DESTINATION_HEADER",
            "imports infergate.envoy.names; outside itself the EPP imports only",
        ),
        (
            "infergate.epp.scheduling.plugins.scorers",
            "from ...requestcontrol.director import Director",
            "(scheduling) imports infergate.epp.requestcontrol.director (requestcontrol)",
        ),
        ("infergate.epp.newthing", "", "infergate.epp.newthing is in no layer"),
    ],
)
def test_an_import_that_climbs_is_named(module: str, source: str, fragment: str) -> None:
    problems = violations(source, module)
    assert len(problems) == 1 and fragment in problems[0], problems


def test_imports_down_or_across_are_allowed() -> None:
    source = (
        "from infergate.epp.types import EndpointState\n"
        "from infergate.epp.framework.requestcontrol import PreRequest\n"
        "from infergate.epp.scheduling.plugins.prefix import prompt_bytes\n"
        "from infergate.epp.scheduling.prefix_index import PrefixIndex\n"
        "from infergate.wire.names import PREFILL_HEADER\n"
        "import json\n"
    )
    assert violations(source, "infergate.epp.scheduling.plugins.scorers") == []
