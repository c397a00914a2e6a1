"""Read an InferencePool object into a checked, typed spec (pure; no API calls).

The CRD already rejects most bad input, but the operator re-checks what it relies on:
the pool may come from an older or foreign CRD, and annotations are free-form. A
problem becomes :class:`InvalidPool` with a condition reason, never an exception
escaping a handler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from infergate.operator import constants as c
from infergate.operator.settings import OperatorSettings

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
MAX_EPP_REPLICAS = 16


class InvalidPool(ValueError):
    """The pool cannot be served as written; ``reason`` goes into the Accepted condition."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class PoolSpec:
    """Everything the builders need about one pool."""

    name: str
    namespace: str
    uid: str
    generation: int
    match_labels: dict[str, str]
    target_ports: tuple[int, ...]
    picker_group: str
    picker_kind: str
    picker_name: str
    picker_port: int | None
    failure_mode: str
    standalone_envoy: bool = False
    epp_replicas: int = 1
    epp_image: str = ""
    epp_config_ref: str | None = None
    epp_config_key: str = c.EPP_CONFIG_KEY
    #: Prefill/decode disaggregation's threshold (None: the pool is not disaggregated).
    pd_threshold: int | None = None
    #: Port the pool's engines publish completion records on (None: not declared).
    completion_events_port: int | None = None
    #: The standalone Envoy's response accounting (see :func:`_response_accounting`).
    response_accounting: str = "observer"
    #: (Secret name, key) holding the engines' --api-key, given to the EPP (None: none).
    engine_api_key_secret: tuple[str, str] | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def manages_picker(self) -> bool:
        """The operator deploys pickers behind core Services only (GIE's default kind)."""
        return self.picker_group == "" and self.picker_kind == "Service"

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def _bool_annotation(annotations: dict[str, str], key: str) -> bool:
    raw = annotations.get(key, "false").strip().lower()
    if raw in ("true", "1", "yes"):
        return True
    if raw in ("false", "0", "no", ""):
        return False
    raise InvalidPool("InvalidAnnotation", f"annotation {key}={raw!r} must be true or false")


def parse_pool(body: dict[str, Any], settings: OperatorSettings) -> PoolSpec:
    """Check and read an InferencePool; raise InvalidPool with a reason on any problem.

    Long for a reason: the checks run in the order the API documents the fields, each
    with the message it raises beside it, so a reader can hold the spec against it."""
    meta = body.get("metadata") or {}
    spec = body.get("spec")
    if not isinstance(spec, dict):
        raise InvalidPool("InvalidSpec", "spec is missing")
    annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}

    labels = (spec.get("selector") or {}).get("matchLabels")
    if not isinstance(labels, dict) or not labels:
        raise InvalidPool("InvalidSelector", "spec.selector.matchLabels must be a non-empty map")
    for key, value in labels.items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            raise InvalidPool(
                "InvalidSelector", f"selector label {key}={value!r} is not a label value"
            )

    raw_ports = spec.get("targetPorts")
    if not isinstance(raw_ports, list) or not 1 <= len(raw_ports) <= 8:
        raise InvalidPool("InvalidTargetPorts", "spec.targetPorts must list 1 to 8 ports")
    ports: list[int] = []
    for item in raw_ports:
        number = item.get("number") if isinstance(item, dict) else None
        if not isinstance(number, int) or not 1 <= number <= 65535:
            raise InvalidPool("InvalidTargetPorts", f"target port {item!r} is not 1-65535")
        if number in ports:
            raise InvalidPool("InvalidTargetPorts", f"target port {number} is listed twice")
        ports.append(number)

    ref = spec.get("endpointPickerRef")
    if ref is None:  # optional since GIE v1.6; the operator needs it to deploy an EPP
        raise InvalidPool(
            "EndpointPickerRefMissing", "infergate deploys an Endpoint Picker only where "
            "spec.endpointPickerRef names its Service; Gateways balance such a pool instead",
        )  # fmt: skip
    if not isinstance(ref, dict) or not ref.get("name"):
        raise InvalidPool("InvalidExtensionRef", "spec.endpointPickerRef.name is required")
    group = ref.get("group", "") or ""
    kind = ref.get("kind", "Service") or "Service"
    failure_mode = ref.get("failureMode", "FailClose") or "FailClose"
    if failure_mode not in ("FailOpen", "FailClose"):
        raise InvalidPool(
            "InvalidExtensionRef", f"failureMode {failure_mode!r} is not FailOpen or FailClose"
        )
    port = (ref.get("port") or {}).get("number")
    if kind == "Service" and not isinstance(port, int):
        raise InvalidPool("InvalidExtensionRef", "endpointPickerRef.port is required for a Service")
    name = str(ref["name"])

    standalone = _bool_annotation(annotations, c.ANNOTATION_STANDALONE_ENVOY)
    replicas_raw = annotations.get(c.ANNOTATION_EPP_REPLICAS, str(settings.epp_replicas))
    try:
        replicas = int(replicas_raw)
    except ValueError:
        replicas = -1
    if not 1 <= replicas <= MAX_EPP_REPLICAS:
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotation {c.ANNOTATION_EPP_REPLICAS}={replicas_raw!r} must be 1-{MAX_EPP_REPLICAS}",
        )

    if group == "" and kind == "Service":
        if not _DNS_LABEL.match(name) or len(name) > 63:
            raise InvalidPool("InvalidExtensionRef", f"{name!r} is not a valid Service name")
        reserved = {c.EPP_METRICS_PORT: "metrics"}
        if standalone:
            reserved[c.ENVOY_LISTEN_PORT] = "the standalone Envoy listener"
        if port in reserved:
            raise InvalidPool(
                "InvalidExtensionRef",
                f"endpointPickerRef.port {port} clashes with the EPP Service's {reserved[port]} port",
            )

    config_ref = annotations.get(c.ANNOTATION_EPP_CONFIG) or None
    pd_threshold = _pd_threshold(annotations, config_ref)
    events_port = _completion_events_port(annotations)
    accounting = _response_accounting(annotations, standalone, events_port)
    return PoolSpec(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation") or 0),
        match_labels={str(k): str(v) for k, v in labels.items()},
        target_ports=tuple(ports),
        picker_group=group,
        picker_kind=kind,
        picker_name=name,
        picker_port=port if isinstance(port, int) else None,
        failure_mode=failure_mode,
        standalone_envoy=standalone,
        epp_replicas=replicas,
        epp_image=annotations.get(c.ANNOTATION_EPP_IMAGE) or settings.epp_image,
        epp_config_ref=config_ref,
        epp_config_key=annotations.get(c.ANNOTATION_EPP_CONFIG_KEY) or c.EPP_CONFIG_KEY,
        pd_threshold=pd_threshold,
        completion_events_port=events_port,
        response_accounting=accounting,
        engine_api_key_secret=_engine_api_key_secret(annotations),
        annotations=annotations,
    )


def _pd_threshold(annotations: dict[str, str], config_ref: str | None) -> int | None:
    """The pool's P/D threshold when it declares ``prefill-decode`` disaggregation."""
    mode = annotations.get(c.ANNOTATION_DISAGGREGATION, "").strip().lower()
    raw = annotations.get(c.ANNOTATION_PD_THRESHOLD)
    if mode in ("", "none"):
        if raw is not None:
            raise InvalidPool(
                "InvalidAnnotation",
                f"annotation {c.ANNOTATION_PD_THRESHOLD} needs "
                f"{c.ANNOTATION_DISAGGREGATION}={c.DISAGGREGATION_PD}",
            )
        return None
    if mode != c.DISAGGREGATION_PD:
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotation {c.ANNOTATION_DISAGGREGATION}={mode!r} must be "
            f"{c.DISAGGREGATION_PD} or none",
        )
    if config_ref is not None:
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotations {c.ANNOTATION_DISAGGREGATION} and {c.ANNOTATION_EPP_CONFIG} both set "
            "the EPP's config; use one (a custom config can use pd-profile-handler itself)",
        )
    try:
        threshold = int(raw) if raw is not None else 256
    except ValueError:
        threshold = -1
    if threshold < 0:
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotation {c.ANNOTATION_PD_THRESHOLD}={raw!r} must be a whole number >= 0",
        )
    return threshold


def _completion_events_port(annotations: dict[str, str]) -> int | None:
    """The engines' completion-records port the pool declares, checked as a port."""
    raw = annotations.get(c.ANNOTATION_COMPLETION_EVENTS_PORT)
    if raw is None or not raw.strip():
        return None
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotation {c.ANNOTATION_COMPLETION_EVENTS_PORT}={raw!r} must be a port 1-65535",
        )
    return port


def _response_accounting(
    annotations: dict[str, str], standalone: bool, events_port: int | None
) -> str:
    """The standalone Envoy's response accounting.

    ``engine`` costs the EPP nothing per response chunk but needs completion records,
    which only infergate engines publish; so it is the default only when the pool
    declares their port, and ``observer`` (any engine, vLLM included) otherwise. An
    explicit annotation wins. With a Gateway the Gateway's own ext-proc settings decide,
    so the annotation is refused there rather than silently ignored.
    """
    raw = annotations.get(c.ANNOTATION_RESPONSE_ACCOUNTING)
    if raw is None or not raw.strip():
        return "engine" if events_port is not None else "observer"
    mode = raw.strip().lower()
    if mode not in c.RESPONSE_ACCOUNTING:
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotation {c.ANNOTATION_RESPONSE_ACCOUNTING}={raw!r} must be one of "
            f"{', '.join(c.RESPONSE_ACCOUNTING)}",
        )
    if not standalone:
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotation {c.ANNOTATION_RESPONSE_ACCOUNTING} configures the standalone Envoy; "
            f"it needs {c.ANNOTATION_STANDALONE_ENVOY}=true",
        )
    return mode


def _engine_api_key_secret(annotations: dict[str, str]) -> tuple[str, str] | None:
    """``NAME`` or ``NAME/KEY``: the Secret (pool namespace) with the engines' API key."""
    raw = annotations.get(c.ANNOTATION_ENGINE_API_KEY_SECRET, "").strip()
    if not raw:
        return None
    name, _, key = raw.partition("/")
    key = key or c.ENGINE_API_KEY_SECRET_KEY
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name) or not _SECRET_KEY.match(key):
        raise InvalidPool(
            "InvalidAnnotation",
            f"annotation {c.ANNOTATION_ENGINE_API_KEY_SECRET}={raw!r} must be a Secret name, "
            "optionally followed by /KEY",
        )
    return name, key
