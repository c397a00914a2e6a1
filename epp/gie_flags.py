"""GIE's and llm-d-router's EPP command line, read by ``infergate epp``.

Their EPP is a Go binary: pflag options, controller-runtime's ``--zap-*`` logging flags,
Go booleans written ``--flag=false``, and Helm charts that write
``--total-queued-requests-metric="sglang:num_queue_reqs"`` with the quotes inside the
argument. So that an infergate EPP image drops into their Deployments, :func:`normalize`
rewrites such an argument list into ``infergate epp``'s own before click parses it:

* flags ``infergate epp`` declares under the same name (``--pool-name``, ``--grpc-port``,
  ``--config-file``, ``--refresh-metrics-interval``, ``--cert-path`` …) pass unchanged,
  except Go's ``--secure-serving=BOOL``, which becomes ``--[no-]secure-serving``;
* :data:`GIE_FLAGS` says what each other flag of theirs does here: mapped to an option of
  ours (``-v``/``--v``, ``--zap-log-level`` → ``--log-level``), accepted and ignored (logging
  format, tracing, pprof: nothing to configure), accepted only with the value infergate
  already behaves as, or refused naming the flag (a behaviour infergate cannot honour
  must not be dropped silently).

The table is the one place these flags are declared: ``infergate epp --help`` and
docs/epp.md list it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["GIE_FLAGS", "GieArgsError", "gie_flags_help", "normalize"]

#: GIE's log verbosity levels (pkg/common/observability/logging): 4 and above is debug.
GIE_DEBUG_VERBOSITY = 4
_TRUE = {"1", "t", "true"}
_FALSE = {"0", "f", "false"}
_VLLM_METRICS = {
    "--total-queued-requests-metric": ("vllm:num_requests_waiting",),
    "--total-running-requests-metric": ("vllm:num_requests_running",),
    "--kv-cache-usage-percentage-metric": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "--lora-info-metric": ("vllm:lora_requests_info", ""),
    "--cache-info-metric": ("vllm:cache_config_info",),
}


class GieArgsError(ValueError):
    """A GIE flag asking for what ``infergate epp`` cannot do; the message names it."""


@dataclass(frozen=True)
class GieFlag:
    """One flag of GIE's EPP and what ``infergate epp`` makes of it."""

    boolean: bool
    """A Go bool: ``--flag`` or ``--flag=BOOL``, never a separate value."""
    note: str
    """What it does here (``--help`` and docs/epp.md)."""
    rewrite: Callable[[str, str], list[str]] | None = None
    """(flag, value) → arguments of ours; None: accepted and ignored. Raises
    :class:`GieArgsError` for a value infergate cannot honour."""


def _bool(flag: str, value: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise GieArgsError(f"{flag}={value}: not a boolean (true or false)")


def _log_level(verbose: bool) -> list[str]:
    return ["--log-level", "debug" if verbose else "info"]


def _verbosity(flag: str, value: str) -> list[str]:
    try:
        level = int(value)
    except ValueError:
        raise GieArgsError(f"{flag} {value}: not an integer") from None
    return _log_level(level >= GIE_DEBUG_VERBOSITY)


def _zap_level(flag: str, value: str) -> list[str]:
    names = {"debug": "debug", "info": "info", "error": "error", "panic": "critical"}
    if value.lower() in names:
        return ["--log-level", names[value.lower()]]
    return _verbosity(flag, value)


def _only_if(expected: bool, why: str) -> Callable[[str, str], list[str]]:
    """A Go bool accepted where it asks for what infergate does; refused otherwise."""

    def check(flag: str, value: str) -> list[str]:
        if _bool(flag, value) != expected:
            raise GieArgsError(f"{flag}={str(not expected).lower()}: {why}")
        return []

    return check


def _only_value(allowed: Sequence[str], why: str) -> Callable[[str, str], list[str]]:
    def check(flag: str, value: str) -> list[str]:
        if value not in allowed:
            raise GieArgsError(f"{flag} {value!r}: {why}")
        return []

    return check


def _refuse(why: str) -> Callable[[str, str], list[str]]:
    def refuse(flag: str, value: str) -> list[str]:
        raise GieArgsError(f"{flag}: {why}")

    return refuse


def _pool_group(flag: str, value: str) -> list[str]:
    if value != "inference.networking.k8s.io":
        raise GieArgsError(f"{flag} {value}: only inference.networking.k8s.io (v1) is served")
    return []


def _metric(flag: str, value: str) -> list[str]:
    """The deprecated metric-name flags: the vLLM names (infergate's default dialect) pass;
    SGLang's are a per-endpoint label here, anything else is refused."""
    if value in _VLLM_METRICS[flag]:
        return []
    if value.startswith("sglang:"):
        raise GieArgsError(
            f"{flag} {value}: infergate picks SGLang's metric names per endpoint; label the "
            "SGLang pods inference.networking.k8s.io/engine-type=sglang and drop this flag"
        )
    raise GieArgsError(f"{flag} {value}: infergate reads vLLM's and SGLang's metric names only")


_IGNORED_LOG = "logging format only: accepted and ignored"
_METRIC_NOTE = "vLLM's name (the default) accepted; others refused (SGLang: pod label)"

GIE_FLAGS: dict[str, GieFlag] = {
    "--v": GieFlag(
        False, "(or -v) verbosity: 4 or more is --log-level debug, else info", _verbosity
    ),
    "--zap-log-level": GieFlag(
        False, "--log-level: debug, info, error, panic (critical); an integer as --v", _zap_level
    ),
    "--zap-encoder": GieFlag(False, _IGNORED_LOG),
    "--zap-devel": GieFlag(True, _IGNORED_LOG),
    "--zap-stacktrace-level": GieFlag(False, _IGNORED_LOG),
    "--zap-time-encoding": GieFlag(False, _IGNORED_LOG),
    "--tracing": GieFlag(True, "OpenTelemetry traces: none are emitted; accepted and ignored"),
    "--enable-pprof": GieFlag(True, "Go's profiler: accepted and ignored"),
    "--health-checking": GieFlag(True, "the gRPC health service always runs; ignored"),
    "--ha-enable-leader-election": GieFlag(
        True, "replicas are active-active (no leader needed); ignored"
    ),
    "--refresh-prometheus-metrics-interval": GieFlag(
        False, "the EPP's own metrics are computed when scraped; ignored"
    ),
    "--pool-group": GieFlag(
        False, "inference.networking.k8s.io accepted; others refused", _pool_group
    ),
    "--metrics-endpoint-auth": GieFlag(
        True,
        "false accepted (the metrics port has no authentication); true refused",
        _only_if(False, "the metrics port has no authentication; put it behind a proxy"),
    ),
    "--disable-endpoint-subset-filter": GieFlag(
        True,
        "false accepted (the subset hint is always honoured); true refused",
        _only_if(False, "infergate always honours x-gateway-destination-endpoint-subset"),
    ),
    "--enable-cert-reload": GieFlag(
        True,
        "false accepted; true refused (certificates are read at start)",
        _only_if(False, "certificates are read at start; restart the EPP to rotate them"),
    ),
    "--model-server-metrics-scheme": GieFlag(
        False,
        "http accepted; https refused",
        _only_value(("http",), "endpoints are scraped over plain HTTP"),
    ),
    "--model-server-metrics-path": GieFlag(
        False,
        "/metrics accepted; others refused",
        _only_value(("/metrics",), "endpoints are scraped at /metrics"),
    ),
    "--model-server-metrics-port": GieFlag(
        False,
        "0 (unset) accepted; others refused",
        _only_value(("0",), "endpoints are scraped on their serving port"),
    ),
    "--model-server-metrics-https-insecure-skip-verify": GieFlag(
        True, "only meaningful with https scraping (refused); ignored"
    ),
    **{flag: GieFlag(False, _METRIC_NOTE, _metric) for flag in _VLLM_METRICS},
    "--endpoint-selector": GieFlag(
        False,
        "refused: discovery is an InferencePool (--pool-name) or --endpoint/--endpoints",
        _refuse("discovery is an InferencePool (--pool-name) or --endpoint/--endpoints"),
    ),
    "--endpoint-target-ports": GieFlag(
        False,
        "refused: the target ports are the InferencePool's",
        _refuse("the target ports are the InferencePool's (spec.targetPorts)"),
    ),
}
#: Our own Go-bool flags: ``--flag=BOOL`` → ``--flag`` / ``--no-flag``.
_OUR_BOOLS = ("--secure-serving",)
_SHORT = {"-v": "--v"}


def _unquote(value: str) -> str:
    """``"x"`` → ``x``: a Helm chart's ``--flag="x"`` keeps the quotes in the argument."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _split(token: str) -> tuple[str, str | None]:
    """A token as (flag, inline value): ``--f=x``, ``-v=4``, ``-v4``."""
    name, eq, inline = token.partition("=")
    if not eq and name.startswith("-v") and not name.startswith("--") and name[2:].isdigit():
        return "-v", name[2:]
    return name, (inline if eq else None)


def normalize(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``args`` (after ``epp``) with GIE's flags rewritten as ``infergate epp``'s, and
    one note per flag accepted and ignored (to log)."""
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        name, inline = _split(token)
        name = _SHORT.get(name, name)
        if name in _OUR_BOOLS and inline is not None:
            out.append(name if _bool(name, inline) else "--no-" + name[2:])
            continue
        flag = GIE_FLAGS.get(name)
        if flag is None:
            out.append(token)
            continue
        if inline is not None:
            value = _unquote(inline)
        elif flag.boolean:
            value = "true"
        elif i < len(args):
            value, i = _unquote(args[i]), i + 1
        else:
            raise GieArgsError(f"{name} needs a value")
        if flag.boolean:
            _bool(name, value)  # a typo is a usage error, even where the value is ignored
        if flag.rewrite is None:
            notes.append(f"{name}: {flag.note}")
        else:
            out += flag.rewrite(name, value)
    return out, notes


def gie_flags_help() -> str:
    """The ``--help`` paragraph: each GIE flag and what it does here."""
    lines = [
        "GIE's and llm-d-router's EPP flags are accepted too (Go forms such as "
        "--secure-serving=false included); the others they pass (docs/epp.md):"
    ]
    lines += [f"* `{name}`: {flag.note}." for name, flag in GIE_FLAGS.items()]
    return "\n\n".join(lines)
