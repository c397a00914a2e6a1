"""``infergate operator``: the kopf operator for InferencePool."""

import typer

from infergate.unbuilt import not_built


def operator(ctx: typer.Context) -> None:
    """Reconcile InferencePools; extra options pass through to `kopf run`."""
    not_built("`infergate operator`", "issue 5 (Kubernetes surface)")
