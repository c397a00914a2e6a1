"""``infergate epp``'s options: each field of :class:`EppOptions` is one flag.

Adding a flag is adding a field with :func:`infergate.options.option`; ``epp/cli.py``
generates the command from these fields, and :meth:`EppOptions.argv` writes the command
line back from them for whoever starts an EPP process (``infergate up``, the operator's
Deployment, the bench rigs). Fields without one (``config``) are for callers that build
an EPP in process (tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infergate.epp.datalayer.discovery.static import parse_endpoint
from infergate.epp.types import Endpoint

from infergate.options import option, to_argv
from infergate.wire.names import MAX_REQUEST_BODY_BYTES

if TYPE_CHECKING:
    from infergate.epp.config import EndpointPickerConfig

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}

#: The port fields: whoever starts an EPP writes them even at their defaults
#: (``EppOptions.argv(always=EPP_PORTS)``), so its command line names its ports.
EPP_PORTS = ("grpc_port", "grpc_health_port", "metrics_port")

#: The environment variable that gives the EPP the engines' ``--api-key`` (never a flag:
#: a command line is visible to every process on the host). The precise-prefix scorer
#: sends it to the engines' ``/tokenize``; ``infergate up`` and the operator (from the
#: engines' Secret) set it.
ENGINE_API_KEY_ENV = "INFERGATE_ENGINE_API_KEY"


def seconds(text: str | float) -> float:
    """``0.05``, ``50ms``, ``2s``, ``1m`` → seconds (> 0); GIE's flags take Go durations."""
    value = str(text).strip().lower()
    scale = 1.0
    for unit in ("ms", "s", "m"):
        if value.endswith(unit):
            value, scale = value[: -len(unit)], _UNITS[unit]
            break
    try:
        result = float(value) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a duration (e.g. 0.05, 50ms, 2s)") from None
    if not result > 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return result


def parse_duration(text: str, flag: str) -> float:
    """:func:`seconds`, with ``flag`` named in the error."""
    try:
        return seconds(text)
    except ValueError as error:
        raise ValueError(f"{flag}: {error}") from None


def _seconds_or_none(text: str | float) -> float | None:
    """``--body-timeout``: a duration, or 0 for none."""
    return None if str(text).strip() in ("0", "0s", "0.0") else seconds(text)


def _seconds_text(value: float | None) -> str:
    """``--body-timeout``'s text for a value: 0 for none."""
    return "0" if value is None else str(value)


def _duration_option(flag: str, default: float, help: str) -> Any:
    """An option in seconds that also takes Go-style durations (``50ms``, ``2s``)."""
    return option(flag, default=default, cli_type=str, convert=seconds, help=help)


def _endpoints(texts: list[str]) -> list[Endpoint]:
    return [parse_endpoint(text) for text in texts]


def _endpoint_texts(endpoints: list[Endpoint]) -> list[str]:
    """``--endpoint``'s texts: HOST:PORT carries no labels (an endpoints file does)."""
    labelled = [e.key for e in endpoints if e.labels]
    if labelled:
        raise ValueError(f"--endpoint cannot carry labels ({', '.join(labelled)}): use --endpoints")
    return [e.key for e in endpoints]


@dataclass
class EppOptions:
    """What one EPP process runs with."""

    pool_name: str | None = option(
        "--pool-name", default=None, help="InferencePool to serve (Kubernetes discovery)."
    )
    pool_namespace: str = option("--pool-namespace", default="default", help="Its namespace.")
    endpoints_file: Path | None = option(
        "--endpoints",
        default=None,
        help="YAML endpoints file (hot-reloaded, atomic renames included).",
    )
    static_endpoints: list[Endpoint] = option(
        "--endpoint",
        default_factory=list,
        cli_type=list[str],
        convert=_endpoints,
        render=_endpoint_texts,
        help="Static endpoint HOST:PORT; may repeat.",
    )
    config_file: Path | None = option(
        "--config-file",
        default=None,
        help="EndpointPickerConfig YAML (plugins and profiles), or a built-in config by name: "
        "builtin:infergate-default (the default), builtin:gie-default (GIE's default "
        "profile), builtin:precise-prefix (infergate's default plus the engines' KV "
        "events), builtin:gie-precise-prefix.",
    )
    config_text: str | None = option(
        "--config-text", default=None, help="The EndpointPickerConfig inline, instead of a file."
    )
    config: EndpointPickerConfig | None = None
    """A parsed config; wins over ``config_text`` and ``config_file``."""
    client_priority_max: int | None = option(
        "--client-priority-max",
        default=None,
        help="The pool owner's opt-in: clients may set their own priority (the body's "
        "`priority` or the x-infergate-priority header, vLLM's convention: lower runs first) "
        "up to this InferenceObjective priority (GIE's convention: higher is more important), "
        "and lower it freely. Unset (the default): the InferenceObjective alone decides; a "
        "client's body `priority` is removed and its header replaced.",
    )
    objectives_file: Path | None = option(
        "--objectives-file",
        default=None,
        help="Standalone mode: YAML of InferenceObjective / InferenceModelRewrite objects "
        "(hot-reloaded).",
    )
    host: str = option("--host", default="0.0.0.0", help="Address to bind all three ports on.")
    grpc_port: int = option("--grpc-port", default=9002, help="ext-proc gRPC port.")
    grpc_health_port: int = option(
        "--grpc-health-port",
        default=9003,
        help="grpc.health.v1 port (NOT_SERVING with no endpoints).",
    )
    metrics_port: int = option("--metrics-port", default=9090, help="Prometheus port.")
    refresh_metrics_interval: float = _duration_option(
        "--refresh-metrics-interval",
        0.05,
        help="Time between scrapes of each endpoint (seconds, or a duration like 50ms).",
    )
    metrics_staleness_threshold: float = _duration_option(
        "--metrics-staleness-threshold",
        2.0,
        help="Age after which an endpoint's metrics are stale (treated as saturated).",
    )
    metrics_timeout: float = _duration_option(
        "--metrics-timeout",
        1.0,
        help="Scrape timeout.",
    )
    max_request_body_bytes: int = option(
        "--max-request-body-bytes",
        default=MAX_REQUEST_BODY_BYTES,
        help="Larger request bodies get 413.",
    )
    max_buffered_bytes: int = option(
        "--max-buffered-bytes",
        default=128 << 20,
        help="Request bodies buffered across all requests in flight; beyond it 503.",
    )
    max_streams: int = option(
        "--max-streams", default=10_000, help="Concurrent ext-proc streams; beyond it 503."
    )
    body_timeout_s: float | None = option(
        "--body-timeout",
        default=20.0,
        cli_type=str,
        convert=_seconds_or_none,
        render=_seconds_text,
        help="A request body must arrive within this (after its headers), else 408; 0 = none.",
    )
    completion_events_port: int | None = option(
        "--completion-events-port",
        default=None,
        help="Subscribe to every endpoint's completion records on this port (engines run "
        "with --completion-events-port); endpoints labelled "
        "infergate.io/completion-events-port are subscribed regardless.",
    )
    scores_header: bool = option(
        "--scores-header",
        default=False,
        help="Debug: add `x-infergate-epp-scores` (per-endpoint totals) to upstream requests.",
    )
    secure_serving: bool = option(
        "--secure-serving/--no-secure-serving",
        default=False,
        help="Serve ext-proc over TLS (GIE's default; Istio expects it). Self-signed unless "
        "--cert-path is given.",
    )
    cert_path: Path | None = option(
        "--cert-path",
        default=None,
        help="Directory with tls.crt and tls.key for --secure-serving.",
    )
    client_ca_file: Path | None = option(
        "--client-ca-file",
        default=None,
        help="With --secure-serving: require a client certificate signed by this CA (PEM) on "
        "the ext-proc port (ext-proc, EDS, health): mutual TLS with the gateway.",
    )
    log_level: str = option(
        "--log-level",
        default="info",
        help="debug logs one line per decision with per-scorer scores.",
    )
    workers: int = option(
        "--workers",
        default=1,
        min=1,
        help="EPP processes behind the one ext-proc port (SO_REUSEPORT); state (prefix index, "
        "flow control) is per process. Worker i serves metrics on --metrics-port + i.",
    )
    grpc_server: str = option(
        "--grpc-server",
        default="h2",
        help="The ext-proc port's gRPC server: h2 (HTTP/2 read by the event loop itself, framed "
        "natively by the h2 crate; the least CPU per request) or aio (grpc.aio, the previous "
        "server: a poller thread hands each gRPC event to the loop); docs/architecture.md.",
    )
    shutdown_delay_s: float = option(
        "--shutdown-delay-s",
        default=0.0,
        min=0.0,
        help="On SIGTERM, first answer NOT_SERVING to every health check for this long while "
        "still serving, so proxies that health-check the EPP stop opening streams to it before "
        "it stops accepting (their endpoint lists may lag). The operator sets it.",
    )
    shutdown_grace_s: float = option(
        "--shutdown-grace-s",
        default=2.0,
        min=0.0,
        help="On SIGTERM: stop accepting, tell each proxy to go away (HTTP/2 GOAWAY) and wait "
        "at most this long for the ext-proc streams in flight (a streamed response's lasts as "
        "long as the response). The operator sets its drain time.",
    )
    reuse_port: bool = option(
        "--reuse-port", default=False, hidden=True, help="Bind with SO_REUSEPORT (set for workers)."
    )
    """Bind the gRPC ports with SO_REUSEPORT (``--workers``: several EPPs, one port)."""

    def argv(self, *, always: Collection[str] = ()) -> list[str]:
        """``infergate``'s arguments that run this EPP: ``epp`` and each flag whose value is
        not its default (and those in ``always``). The one place an EPP command line is
        built; ``ValueError`` for what no flag carries (``config``: write it to a file)."""
        return ["epp", *to_argv(self, always=always)]
