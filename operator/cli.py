"""``infergate operator``: the kopf operator for InferencePool."""

from __future__ import annotations

import secrets

import typer

HANDLERS_MODULE = "infergate.operator.handlers"


def kopf_argv(extra: list[str]) -> list[str]:
    """``kopf run`` arguments: our handlers, all namespaces and JSON logs unless overridden."""
    argv = ["run", "--module", HANDLERS_MODULE]
    scoped = any(
        a in ("-A", "--all-namespaces", "-n", "--namespace") or a.startswith("--namespace=")
        for a in extra
    )
    if not scoped:
        argv.append("--all-namespaces")
    if not any(a.startswith("--log-format") for a in extra):
        argv.append("--log-format=json")
    peering = any(a in ("-P", "--peering") or a.startswith("--peering=") for a in extra)
    prioritised = any(a in ("-p", "--priority") or a.startswith("--priority=") for a in extra)
    if peering and not prioritised:
        # Equal priorities make kopf pause *every* replica; a random one per process
        # makes exactly one active and the others standbys, whichever starts first.
        argv.append(f"--priority={secrets.randbelow(1_000_000) + 1}")
    return [*argv, *extra]


def operator(ctx: typer.Context) -> None:
    """Reconcile InferencePools. Extra options pass through to `kopf run`.

    Defaults: `--all-namespaces --log-format=json`. Useful kopf options:
    `--namespace NS` (repeatable), `--liveness http://0.0.0.0:8080/healthz`,
    `--peering NAME` / `--standalone` (HA peering; without `--priority` each replica
    takes a random one, so exactly one is active), `--verbose`.
    Settings for deployed EPPs come from INFERGATE_* environment variables
    (see docs/kubernetes.md).
    """
    from kopf.cli import main as kopf_main

    kopf_main.main(args=kopf_argv(list(ctx.args)), prog_name="infergate operator")
