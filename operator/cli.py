"""``infergate operator``: the kopf operator for InferencePool, and the Gateway API
controller (GatewayClass ``infergate.io/gateway-controller``)."""

from __future__ import annotations

import inspect
import os
import secrets
from typing import Any

import typer

from infergate.operator.settings import GatewaySettings
from infergate.options import command

HANDLERS_MODULE = "infergate.operator.handlers"
GATEWAY_MODULE = "infergate.operator.gateway.controller"


def kopf_argv(extra: list[str], gateway: bool = True) -> list[str]:
    """``kopf run`` arguments: our handlers (the Gateway controller's too, unless disabled),
    all namespaces and JSON logs unless overridden."""
    argv = ["run", "--module", HANDLERS_MODULE]
    if gateway:
        argv += ["--module", GATEWAY_MODULE]
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


_gateway_settings = command(GatewaySettings)(lambda settings: settings)
"""Our own flags parsed into :class:`GatewaySettings` (the typer command ``command``
makes, called directly)."""


def operator(ctx: typer.Context, **values: Any) -> None:
    """Reconcile InferencePools and Gateways. Other options pass through to `kopf run`.

    Defaults: `--all-namespaces --log-format=json`. Useful kopf options:
    `--namespace NS` (repeatable), `--liveness http://0.0.0.0:8080/healthz`,
    `--peering NAME` / `--standalone` (HA peering; without `--priority` each replica
    takes a random one, so exactly one is active), `--verbose`.
    Settings for deployed EPPs come from INFERGATE_* environment variables
    (see docs/kubernetes.md).
    """
    from kopf.cli import main as kopf_main

    settings: GatewaySettings = _gateway_settings(**values)
    # kopf runs our handlers in this process: they read the settings back from here.
    os.environ.update(settings.to_env())
    kopf_main.main(
        args=kopf_argv(list(ctx.args), gateway=settings.enabled), prog_name="infergate operator"
    )


operator.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        *inspect.signature(_gateway_settings).parameters.values(),
    ]
)
