"""The operator's imports go one way: down the layers below, never back up.

Settings and constants at the bottom; the pure parts over them (the Kubernetes client,
status helpers, the pool's spec, the objects an InferencePool owns); the InferencePool
reconcile over those; the Gateway controller's parts (``operator/gateway/``) over the
reconcile (they reuse its subset comparison and the object builders); the two kopf
modules, which nothing imports (``infergate operator`` loads them by name); the CLI on
top. Outside itself the operator imports the EPP's config, options and TLS, the Envoy and
Gateway translators, :mod:`infergate.options` and :mod:`infergate.wire` — never the
local stack, the benchmarks or the engine.
"""

from __future__ import annotations

import importlib

import pytest

from infergate.operator.cli import kopf_argv
from tests.layering import REPO, LayerTable

OP = "infergate.operator"

OPERATOR = LayerTable(
    package=OP,
    folder=REPO / "operator",
    layers=(
        (
            "outside",
            (
                "infergate.options",
                "infergate.wire",
                "infergate.epp",
                "infergate.envoy",
                "infergate.gateway",
            ),
        ),
        ("settings", (f"{OP}.constants", f"{OP}.settings")),
        (
            "parts",
            (f"{OP}.kube", f"{OP}.status", f"{OP}.eppconfig", f"{OP}.pool", f"{OP}.builders"),
        ),
        ("reconcile", (f"{OP}.reconcile", f"{OP}.policy")),
        ("gateway", (f"{OP}.gateway",)),
        ("kopf", (f"{OP}.handlers", f"{OP}.gateway.controller")),
        ("cli", (f"{OP}.cli",)),
    ),
    outside=(
        "outside itself the operator imports only infergate.epp, infergate.envoy, "
        "infergate.gateway, infergate.options and infergate.wire"
    ),
)


def test_every_operator_import_goes_down_the_layers() -> None:
    problems = OPERATOR.all_violations()
    assert not problems, "\n".join(problems)


def test_nothing_imports_the_kopf_modules() -> None:
    """kopf registers a module's handlers when it loads it; a module imported by another
    would register them twice, or where kopf does not run."""
    kopf = {f"{OP}.handlers", f"{OP}.gateway.controller"}
    for module in sorted(OPERATOR.modules() - kopf):
        for line, target in OPERATOR.imports_of(module):
            assert target not in kopf, f"{module}:{line} {target}"


def test_every_module_kopf_runs_imports() -> None:
    """``kopf run --module`` takes names as strings: a moved module must be renamed there."""
    argv = kopf_argv([])
    modules = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--module"]
    assert modules == [f"{OP}.handlers", f"{OP}.gateway.controller"]
    for name in modules:
        assert OPERATOR.layer_name(name) == "kopf"
        importlib.import_module(name)


def test_the_walk_sees_the_whole_operator() -> None:
    names = OPERATOR.modules()
    assert {
        f"{OP}.reconcile",
        f"{OP}.gateway",
        f"{OP}.gateway.controller",
        f"{OP}.gateway.objects",
        f"{OP}.gateway.status",
        f"{OP}.gateway.sync",
        f"{OP}.gateway.xds",
    } <= names
    assert all(OPERATOR.layer_of(m) is not None for m in names)


@pytest.mark.parametrize(
    ("module", "source", "fragment"),
    [
        (
            f"{OP}.reconcile",
            "from infergate.operator.gateway.objects import proxy_name",
            "(reconcile) imports infergate.operator.gateway.objects (gateway)",
        ),
        (
            f"{OP}.gateway.sync",
            "from infergate.operator.gateway import controller",
            "(gateway) imports infergate.operator.gateway.controller (kopf)",
        ),
        (
            f"{OP}.builders",
            "def f():\n    from infergate.operator import reconcile\n",
            "(parts) imports infergate.operator.reconcile (reconcile)",
        ),
        (
            f"{OP}.settings",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from infergate.operator.kube import Kube\n",
            "(settings) imports infergate.operator.kube (parts)",
        ),
        (
            f"{OP}.builders",
            "from infergate.stack.local import LocalStack",
            "imports infergate.stack.local; outside itself the operator",
        ),
        (
            f"{OP}.gateway.xds",
            "from infergate.engine.serve import ServeOptions",
            "imports infergate.engine.serve; outside itself the operator",
        ),
        (f"{OP}.newthing", "", "infergate.operator.newthing is in no layer"),
    ],
)
def test_an_import_that_climbs_is_named(module: str, source: str, fragment: str) -> None:
    problems = OPERATOR.violations(source, module)
    assert len(problems) == 1 and fragment in problems[0], problems


def test_imports_down_or_across_are_allowed() -> None:
    source = (
        "from infergate.operator import constants as c\n"
        "from infergate.operator.gateway import status as gs\n"
        "from infergate.operator.gateway.objects import proxy_name\n"
        "from infergate.operator.reconcile import is_up_to_date\n"
        "from infergate.gateway.types import GATEWAY_GROUP\n"
    )
    assert OPERATOR.violations(source, f"{OP}.gateway.sync") == []
