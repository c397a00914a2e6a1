"""``infergate up``: the whole stack on one machine."""

from pathlib import Path

import typer

from infergate.unbuilt import not_built


def up(
    engines: int = typer.Option(2, "--engines", help="How many engine processes to start."),
    simulate: bool = typer.Option(
        True, "--simulate/--no-simulate", help="Simulated engines (timing model, no forward pass)."
    ),
    model: Path | None = typer.Option(
        None, "--model", help="Model directory for real engines (e.g. from make-tiny-model)."
    ),
    port: int = typer.Option(8081, "--port", help="Envoy's client listener port."),
) -> None:
    """Run N engines, one Endpoint Picker and one real Envoy on loopback; Ctrl-C stops all."""
    not_built("`infergate up` (the local stack)", "issue 4 (Endpoint Picker)")
