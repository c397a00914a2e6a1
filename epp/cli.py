"""``infergate epp``: the Endpoint Picker."""

from pathlib import Path
from typing import Any

import typer

HELP = """Run the Envoy ext-proc Endpoint Picker (EPP) for a pool of engine endpoints.

Envoy streams each request to the EPP (gRPC on --grpc-port, FULL_DUPLEX_STREAMED bodies);
the EPP answers with the header `x-gateway-destination-endpoint: ip:port` (and the same
value as dynamic metadata `envoy.lb`) chosen from live engine metrics and prefix-cache
affinity.

Pick exactly one endpoint source:

* `--endpoint 127.0.0.1:8000 --endpoint 127.0.0.1:8001` — a fixed list;

* `--endpoints endpoints.yaml` — `endpoints: [{address, port, labels}]`, hot-reloaded;

* `--pool-name NAME [--pool-namespace NS]` — watch an InferencePool in Kubernetes.

Scheduling is configured by an EndpointPickerConfig (`--config-file`, GIE's format);
without one: queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3,
max-score-picker. See docs/epp.md.
"""


def epp(
    pool_name: str | None = typer.Option(
        None, "--pool-name", help="InferencePool to serve (Kubernetes discovery)."
    ),
    pool_namespace: str = typer.Option("default", "--pool-namespace", help="Its namespace."),
    endpoints: Path | None = typer.Option(
        None, "--endpoints", help="YAML endpoints file (hot-reloaded, atomic renames included)."
    ),
    endpoint: list[str] = typer.Option(
        [], "--endpoint", help="Static endpoint HOST:PORT; may repeat."
    ),
    config_file: Path | None = typer.Option(
        None,
        "--config-file",
        help="EndpointPickerConfig YAML (plugins and profiles), or a built-in config by name: "
        "builtin:infergate-default (the default), builtin:gie-default (GIE's default "
        "profile), builtin:precise-prefix (infergate's default plus the engines' KV "
        "events), builtin:gie-precise-prefix.",
    ),
    config_text: str | None = typer.Option(
        None, "--config-text", help="The EndpointPickerConfig inline, instead of a file."
    ),
    objectives_file: Path | None = typer.Option(
        None,
        "--objectives-file",
        help="Standalone mode: YAML of InferenceObjective / InferenceModelRewrite objects "
        "(hot-reloaded).",
    ),
    host: str = typer.Option("0.0.0.0", "--host", help="Address to bind all three ports on."),
    grpc_port: int = typer.Option(9002, "--grpc-port", help="ext-proc gRPC port."),
    grpc_health_port: int = typer.Option(
        9003, "--grpc-health-port", help="grpc.health.v1 port (NOT_SERVING with no endpoints)."
    ),
    metrics_port: int = typer.Option(9090, "--metrics-port", help="Prometheus port."),
    refresh_metrics_interval: str = typer.Option(
        "50ms",
        "--refresh-metrics-interval",
        help="Time between scrapes of each endpoint (seconds, or a duration like 50ms).",
    ),
    metrics_staleness_threshold: str = typer.Option(
        "2s",
        "--metrics-staleness-threshold",
        help="Age after which an endpoint's metrics are stale (treated as saturated).",
    ),
    metrics_timeout: str = typer.Option("1s", "--metrics-timeout", help="Scrape timeout."),
    max_request_body_bytes: int = typer.Option(
        8 << 20, "--max-request-body-bytes", help="Larger request bodies get 413."
    ),
    max_buffered_bytes: int = typer.Option(
        128 << 20,
        "--max-buffered-bytes",
        help="Request bodies buffered across all requests in flight; beyond it 503.",
    ),
    max_streams: int = typer.Option(
        10_000, "--max-streams", help="Concurrent ext-proc streams; beyond it 503."
    ),
    body_timeout: str = typer.Option(
        "20s",
        "--body-timeout",
        help="A request body must arrive within this (after its headers), else 408; 0 = none.",
    ),
    completion_events_port: int | None = typer.Option(
        None,
        "--completion-events-port",
        help="Subscribe to every endpoint's completion records on this port (engines run "
        "with --completion-events-port); endpoints labelled "
        "infergate.io/completion-events-port are subscribed regardless.",
    ),
    scores_header: bool = typer.Option(
        False,
        "--scores-header",
        help="Debug: add `x-infergate-epp-scores` (per-endpoint totals) to upstream requests.",
    ),
    secure_serving: bool = typer.Option(
        False,
        "--secure-serving/--no-secure-serving",
        help="Serve ext-proc over TLS (GIE's default; Istio expects it). Self-signed unless "
        "--cert-path is given.",
    ),
    cert_path: Path | None = typer.Option(
        None, "--cert-path", help="Directory with tls.crt and tls.key for --secure-serving."
    ),
    log_level: str = typer.Option(
        "info", "--log-level", help="debug logs one line per decision with per-scorer scores."
    ),
    workers: int = typer.Option(
        1,
        "--workers",
        min=1,
        help="EPP processes behind the one ext-proc port (SO_REUSEPORT); state (prefix index, "
        "flow control) is per process. Worker i serves metrics on --metrics-port + i.",
    ),
    reuse_port: bool = typer.Option(
        False, "--reuse-port", hidden=True, help="Bind with SO_REUSEPORT (set for workers)."
    ),
) -> None:
    """Run the Envoy ext-proc Endpoint Picker for a pool of engine endpoints."""
    import asyncio
    import logging

    from infergate.epp.config import ConfigError, load_config, parse_config
    from infergate.epp.datalayer.discovery.file import EndpointsFileError
    from infergate.epp.datalayer.discovery.static import parse_endpoint
    from infergate.epp.datalayer.objectives import ObjectivesError

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sources = sum(bool(x) for x in (pool_name, endpoints, endpoint))
    if sources != 1:
        typer.echo(
            "infergate epp: give exactly one of --pool-name, --endpoints FILE, --endpoint HOST:PORT",
            err=True,
        )
        raise typer.Exit(2)
    try:
        static = [parse_endpoint(e) for e in endpoint]
    except ValueError as error:
        typer.echo(f"infergate epp: --endpoint: {error}", err=True)
        raise typer.Exit(2) from None
    try:
        interval = parse_duration(refresh_metrics_interval, "--refresh-metrics-interval")
        staleness = parse_duration(metrics_staleness_threshold, "--metrics-staleness-threshold")
        scrape_timeout = parse_duration(metrics_timeout, "--metrics-timeout")
    except ValueError as error:
        typer.echo(f"infergate epp: {error}", err=True)
        raise typer.Exit(2) from None

    from infergate.epp.app import Epp, EppOptions, run

    try:
        config = (
            parse_config(config_text, "--config-text") if config_text else load_config(config_file)
        )
        options = EppOptions(
            static_endpoints=static,
            endpoints_file=endpoints,
            pool_name=pool_name,
            pool_namespace=pool_namespace,
            config=config,
            objectives_file=objectives_file,
            host=host,
            grpc_port=grpc_port,
            grpc_health_port=grpc_health_port,
            metrics_port=metrics_port,
            refresh_metrics_interval=interval,
            metrics_staleness_threshold=staleness,
            metrics_timeout=scrape_timeout,
            max_request_body_bytes=max_request_body_bytes,
            max_buffered_bytes=max_buffered_bytes,
            max_streams=max_streams,
            body_timeout_s=(
                None
                if body_timeout.strip() in ("0", "0s")
                else parse_duration(body_timeout, "--body-timeout")
            ),
            scores_header=scores_header,
            completion_events_port=completion_events_port,
            secure_serving=secure_serving,
            cert_path=cert_path,
            reuse_port=reuse_port,
        )
        Epp(options)  # validate everything (plugins, parameters, files) before binding
    except (ConfigError, EndpointsFileError, ObjectivesError) as error:
        typer.echo(f"infergate epp: invalid configuration: {error}", err=True)
        raise typer.Exit(2) from None
    if workers > 1:
        import sys

        from infergate.epp.workers import run_workers

        if grpc_port == 0 or grpc_health_port == 0:
            typer.echo("infergate epp: --workers needs fixed --grpc-port and --grpc-health-port",
                       err=True)  # fmt: skip
            raise typer.Exit(2)
        raise typer.Exit(run_workers(sys.argv[1:], workers, metrics_port))
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(run(options))
    except OSError as error:
        typer.echo(f"infergate epp: {error}", err=True)
        raise typer.Exit(1) from None


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}


def parse_duration(text: str, flag: str) -> float:
    """``0.05``, ``50ms``, ``2s``, ``1m`` → seconds (> 0); GIE's flags take Go durations."""
    value = text.strip().lower()
    scale = 1.0
    for unit in ("ms", "s", "m"):
        if value.endswith(unit):
            value, scale = value[: -len(unit)], _UNITS[unit]
            break
    try:
        seconds = float(value) * scale
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a duration (e.g. 0.05, 50ms, 2s)") from None
    if not seconds > 0:
        raise ValueError(f"{flag}: must be > 0, got {text!r}")
    return seconds


def _loop_factory() -> Any:
    """uvloop when installed (it ships with uvicorn[standard]): a cheaper event loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


epp.__doc__ = HELP
