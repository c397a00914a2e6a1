"""``infergate epp``: the Endpoint Picker."""

from pathlib import Path

import typer

from infergate.unbuilt import not_built


def epp(
    pool_name: str | None = typer.Option(None, "--pool-name", help="InferencePool to serve."),
    pool_namespace: str = typer.Option("default", "--pool-namespace"),
    endpoints: Path | None = typer.Option(
        None, "--endpoints", help="YAML endpoints file (hot-reloaded)."
    ),
    endpoint: list[str] = typer.Option(
        [], "--endpoint", help="Static endpoint HOST:PORT; may repeat."
    ),
    config_file: Path | None = typer.Option(
        None, "--config-file", help="EndpointPickerConfig YAML."
    ),
    grpc_port: int = typer.Option(9002, "--grpc-port"),
    grpc_health_port: int = typer.Option(9003, "--grpc-health-port"),
    metrics_port: int = typer.Option(9090, "--metrics-port"),
    refresh_metrics_interval: float = typer.Option(0.05, "--refresh-metrics-interval"),
    metrics_staleness_threshold: float = typer.Option(2.0, "--metrics-staleness-threshold"),
) -> None:
    """Run the Envoy ext-proc Endpoint Picker for a pool of engine endpoints."""
    not_built("`infergate epp`", "issue 4 (Endpoint Picker)")
