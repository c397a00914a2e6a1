"""Operator-wide settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from infergate.options import cli_fields, option


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default) or default


@dataclass(frozen=True)
class OperatorSettings:
    """What every EPP the operator deploys gets unless a pool annotation says otherwise."""

    epp_image: str = "ghcr.io/infergate/epp:latest"
    envoy_image: str = "docker.io/envoyproxy/envoy:v1.33-latest"
    image_pull_policy: str = "IfNotPresent"
    epp_replicas: int = 1
    epp_cpu_request: str = "250m"
    epp_memory_request: str = "256Mi"
    epp_memory_limit: str = "1Gi"
    envoy_cpu_request: str = "100m"
    envoy_memory_request: str = "128Mi"
    envoy_memory_limit: str = "512Mi"
    #: The longest a stream may still run once its pod is deleted: a Gateway's Envoy
    #: drains this long at most (its shutdown manager, infergate.envoy.drain), an EPP
    #: waits this long for its ext-proc streams. Envoy Gateway's default is 60 s; a
    #: streamed generation can outlast that.
    drain_seconds: float = 300.0
    epp_log_level: str = "info"
    #: Seconds between full resyncs of each pool (status follows pods even without events).
    resync_seconds: float = 30.0
    extra_epp_args: tuple[str, ...] = field(default_factory=tuple)
    #: False: the operator deploys no Endpoint Picker and writes no pool parent of its
    #: own; pools are served through Gateways only, with the EPPs their users deploy (as
    #: GIE's conformance suite deploys its reference EPP).
    manage_endpoint_pickers: bool = True

    @property
    def envoy_max_heap_bytes(self) -> int:
        """Envoy's overload-manager heap bound: 80 % of its container's memory limit, the
        rest for what is not heap (as Envoy Gateway does)."""
        return int(memory_bytes(self.envoy_memory_limit) * 0.8)

    @classmethod
    def from_env(cls) -> OperatorSettings:
        base = cls()
        return cls(
            epp_image=_env("INFERGATE_EPP_IMAGE", base.epp_image),
            envoy_image=_env("INFERGATE_ENVOY_IMAGE", base.envoy_image),
            image_pull_policy=_env("INFERGATE_IMAGE_PULL_POLICY", base.image_pull_policy),
            epp_replicas=int(_env("INFERGATE_EPP_REPLICAS", str(base.epp_replicas))),
            epp_cpu_request=_env("INFERGATE_EPP_CPU_REQUEST", base.epp_cpu_request),
            epp_memory_request=_env("INFERGATE_EPP_MEMORY_REQUEST", base.epp_memory_request),
            epp_memory_limit=_env("INFERGATE_EPP_MEMORY_LIMIT", base.epp_memory_limit),
            resync_seconds=float(_env("INFERGATE_RESYNC_SECONDS", str(base.resync_seconds))),
            drain_seconds=_non_negative("INFERGATE_DRAIN_SECONDS", base.drain_seconds),
            extra_epp_args=tuple(os.environ.get("INFERGATE_EPP_EXTRA_ARGS", "").split()),
            manage_endpoint_pickers=_env(MANAGE_EPP_ENV, "true").strip().lower()
            not in ("0", "false", "no", "off"),
        )


MANAGE_EPP_ENV = "INFERGATE_MANAGE_ENDPOINT_PICKERS"


def _non_negative(name: str, default: float) -> float:
    """A number of seconds from the environment; a clear error for anything else."""
    text = _env(name, str(default))
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a number of seconds") from None
    if not value >= 0:
        raise ValueError(f"{name}={text!r}: must be >= 0")
    return value


_QUANTITY_SUFFIXES = {
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
}  # fmt: skip


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``512Mi``, ``1Gi``, ``1G``, ``1048576``) in bytes."""
    text = quantity.strip()
    for suffix, scale in _QUANTITY_SUFFIXES.items():
        if text.endswith(suffix) and text[: -len(suffix)]:
            text, factor = text[: -len(suffix)], scale
            break
    else:
        factor = 1
    try:
        value = float(text) * factor
    except ValueError:
        raise ValueError(f"not a memory quantity: {quantity!r} (e.g. 512Mi, 1Gi)") from None
    if value <= 0:
        raise ValueError(f"memory quantity must be > 0: {quantity!r}")
    return int(value)


SERVICE_TYPES = ("LoadBalancer", "NodePort", "ClusterIP")
"""What a Gateway's Service may be (per Gateway: annotation ``infergate.io/service-type``)."""


def _service_type(value: str) -> str:
    if value not in SERVICE_TYPES:
        raise ValueError(f"{value!r} is not one of {', '.join(SERVICE_TYPES)}")
    return value


@dataclass(frozen=True)
class GatewaySettings:
    """The Gateway API controller's options, declared once: each field is both an
    ``infergate operator`` flag and the environment variable the chart sets."""

    enabled: bool = option(
        "--gateway/--no-gateway", default=True, envvar="INFERGATE_GATEWAY",
        help="Be the GatewayClass controller infergate.io/gateway-controller: Gateways of "
        "its classes become Envoy Deployments configured over xDS from this process.",
    )  # fmt: skip
    xds_port: int = option(
        "--xds-port", default=18000, envvar="INFERGATE_XDS_PORT", min=1, max=65535,
        help="Port of the ADS (xDS) server the Gateways' Envoys dial.",
    )  # fmt: skip
    xds_listen_address: str = option(
        "--xds-listen-address", default="0.0.0.0", envvar="INFERGATE_XDS_LISTEN_ADDRESS",
        help="Address the xDS server binds.",
    )  # fmt: skip
    xds_address: str = option(
        "--xds-address", default="127.0.0.1", envvar="INFERGATE_XDS_ADDRESS",
        help="Host the Gateways' Envoys dial for xDS: the DNS name of the operator's xDS "
        "Service (the chart sets it).",
    )  # fmt: skip
    service_type: str = option(
        "--gateway-service-type", default="LoadBalancer", envvar="INFERGATE_GATEWAY_SERVICE_TYPE",
        convert=_service_type,
        help="Type of each Gateway's Service unless its annotation infergate.io/service-type "
        f"says otherwise: {', '.join(SERVICE_TYPES)}.",
    )  # fmt: skip
    manage_endpoint_pickers: bool = option(
        "--manage-endpoint-pickers/--no-manage-endpoint-pickers", default=True,
        envvar=MANAGE_EPP_ENV,
        help="Deploy an Endpoint Picker for every InferencePool and report the pool under "
        "the operator's own parent. --no-manage-endpoint-pickers: pools are only backends "
        "of Gateways, with the EPPs their users deploy (GIE's conformance suite does).",
    )  # fmt: skip
    debounce_seconds: float = option(
        "--gateway-debounce", default=0.05, envvar="INFERGATE_GATEWAY_DEBOUNCE", min=0.0,
        help="Seconds the Gateway controller waits after a change before it translates, so "
        "a burst of changes costs one pass.",
    )  # fmt: skip

    @classmethod
    def from_env(cls) -> GatewaySettings:
        """The settings as ``infergate operator`` left them in the environment (it exports
        its parsed flags there, so kopf's handlers in the same process read them)."""
        values: dict[str, Any] = {}
        for f, spec in cli_fields(cls):
            raw = os.environ.get(spec.settings["envvar"], "")
            if raw:
                value = _parse(type(f.default), raw)
                values[f.name] = spec.convert(value) if spec.convert else value
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment :meth:`from_env` reads these settings back from."""
        return {
            spec.settings["envvar"]: _unparse(getattr(self, f.name))
            for f, spec in cli_fields(type(self))
        }


def _parse(kind: type, raw: str) -> Any:
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def _unparse(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)
