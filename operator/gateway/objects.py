"""Pure builders of what one Gateway runs on: an Envoy Deployment, its bootstrap in a
ConfigMap and a Service exposing its listeners.

No API calls here (the reconcile loop in :mod:`infergate.operator.gateway.controller` applies the
result). Every object is owned by its Gateway, so deleting the Gateway garbage-collects
them, and carries the hash of its own content (like the pool builders) so a resync can
tell "already applied" from "changed" without a write. The proxy learns listeners, routes
and clusters over xDS from the operator; the bootstrap only says where the operator is.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from infergate.envoy.drain import SHUTDOWN_PATH, DrainOptions
from infergate.gateway.types import GATEWAY_GROUP
from infergate.operator import constants as c
from infergate.operator.builders import RUN_AS_USER, digest, with_spec_hash
from infergate.operator.settings import OperatorSettings

Obj = dict[str, Any]

GATEWAY_KIND = "Gateway"
GATEWAY_API_VERSION = f"{GATEWAY_GROUP}/v1"
#: On every object the operator makes for a Gateway: its proxy name (the index filter).
LABEL_GATEWAY = "infergate.io/gateway"
#: The label Gateway API asks implementations to put on what they make for a Gateway.
LABEL_GATEWAY_NAME = f"{GATEWAY_GROUP}/gateway-name"
#: Per Gateway: the type of its Service (one of settings.SERVICE_TYPES).
ANNOTATION_SERVICE_TYPE = "infergate.io/service-type"
PROXY_COMPONENT = "gateway-proxy"
ENVOY_CONTAINER = "envoy"
DRAIN_CONTAINER = "shutdown-manager"
#: Beyond the drain timeout, the pod's grace period leaves this long for the admin calls
#: and Envoy's own exit before the kubelet's SIGKILL.
GRACE_MARGIN_S = 15
#: What the proxy objects' kinds are, in the order a stale set is deleted.
PROXY_KINDS = ("Service", "Deployment", "ConfigMap")

_SUFFIX = "-infergate"
_MAX_NAME = 63  # a Service name is a DNS-1035 label


@dataclass(frozen=True)
class ProxyConfig:
    """What the xDS side decides about each Gateway's Envoy: its bootstrap, the extra
    command-line arguments (Kubernetes expands ``$(POD_IP)`` and friends in them), the
    port and path of its readiness endpoint, its admin port (loopback) and the port of its
    shutdown manager (:func:`build_drain_container`)."""

    bootstrap: Obj
    args: tuple[str, ...] = ()
    ready_port: int = 19001
    ready_path: str = "/ready"
    admin_port: int = 19000
    drain_port: int = 19002


def proxy_name(gateway_name: str) -> str:
    """The name of a Gateway's Deployment, Service and ConfigMap: a DNS-1035 label of at
    most 63 characters that two Gateways of one namespace never share."""
    base = gateway_name.replace(".", "-")
    if not base[:1].isalpha():
        base = f"gw-{base}"
    if len(base) + len(_SUFFIX) <= _MAX_NAME and base == gateway_name:
        return base + _SUFFIX
    # Shortened or rewritten: a hash of the real name keeps distinct Gateways distinct.
    tag = hashlib.sha256(gateway_name.encode()).hexdigest()[:8]
    keep = _MAX_NAME - len(_SUFFIX) - len(tag) - 1
    return f"{base[:keep].rstrip('-')}-{tag}{_SUFFIX}"


def _meta(gateway: Obj) -> Obj:
    meta: Obj = gateway.get("metadata") or {}
    return meta


def selector_labels(gateway: Obj) -> dict[str, str]:
    """The labels that pick a Gateway's Envoy pods (immutable once its Deployment exists)."""
    return {c.LABEL_NAME: "infergate-gateway", c.LABEL_INSTANCE: proxy_name(_meta(gateway)["name"])}


def common_labels(gateway: Obj) -> dict[str, str]:
    """Our labels, over the Gateway's ``spec.infrastructure.labels`` (which the Gateway API
    asks to propagate to everything made for the Gateway)."""
    name = _meta(gateway)["name"]
    labels = {
        **_infrastructure(gateway, "labels"),
        **selector_labels(gateway),
        c.LABEL_COMPONENT: PROXY_COMPONENT,
        c.LABEL_MANAGED_BY: "infergate-operator",
        LABEL_GATEWAY: proxy_name(name),
    }
    if len(name) <= _MAX_NAME:
        labels[LABEL_GATEWAY_NAME] = name
    return labels


def _infrastructure(gateway: Obj, field: str) -> dict[str, str]:
    infrastructure = (gateway.get("spec") or {}).get("infrastructure") or {}
    return {str(k): str(v) for k, v in (infrastructure.get(field) or {}).items()}


def owner_reference(gateway: Obj) -> Obj:
    meta = _meta(gateway)
    return {
        "apiVersion": GATEWAY_API_VERSION,
        "kind": GATEWAY_KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _object_meta(gateway: Obj) -> Obj:
    meta = _meta(gateway)
    out: Obj = {
        "name": proxy_name(meta["name"]),
        "namespace": meta.get("namespace") or "default",
        "labels": common_labels(gateway),
        "ownerReferences": [owner_reference(gateway)],
    }
    annotations = _infrastructure(gateway, "annotations")
    if annotations:
        out["annotations"] = annotations
    return out


@dataclass(frozen=True)
class ServicePort:
    name: str
    port: int


def listener_ports(gateway: Obj) -> list[ServicePort]:
    """One port per distinct listener port (listeners may share a port by hostname)."""
    seen: dict[int, ServicePort] = {}
    for listener in (gateway.get("spec") or {}).get("listeners") or []:
        port = int(listener.get("port") or 0)
        if 0 < port < 65536 and port not in seen:
            protocol = re.sub(r"[^a-z0-9]", "", str(listener.get("protocol") or "tcp").lower())
            seen[port] = ServicePort(f"{protocol[:8] or 'tcp'}-{port}", port)
    return sorted(seen.values(), key=lambda p: p.port)


def service_type(gateway: Obj, default: str) -> str:
    """The Service type the Gateway's annotation asks for, else ``default`` (an unknown
    value is ignored rather than applied: the API server would refuse the Service)."""
    wanted = (_meta(gateway).get("annotations") or {}).get(ANNOTATION_SERVICE_TYPE, "")
    return wanted if wanted in ("LoadBalancer", "NodePort", "ClusterIP") else default


def build_config_map(gateway: Obj, proxy: ProxyConfig) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _object_meta(gateway),
        "data": {c.ENVOY_CONFIG_KEY: yaml.safe_dump(proxy.bootstrap, sort_keys=False)},
    }


def _security_context(low_ports: bool) -> Obj:
    """Restricted, like the EPP's; a port below 1024 may be bound (NET_BIND_SERVICE, the
    one capability the restricted Pod Security profile lets a container add)."""
    capabilities: Obj = {"drop": ["ALL"]}
    if low_ports:
        capabilities["add"] = ["NET_BIND_SERVICE"]
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": capabilities,
    }


def _pod_security_context(low_ports: bool) -> Obj:
    """A non-root Envoy gets no capability from ``add`` unless its binary has file
    capabilities; the safe sysctl below lets it bind ports under 1024 either way."""
    context: Obj = {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if low_ports:
        context["sysctls"] = [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}]
    return context


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def build_envoy_container(gateway: Obj, proxy: ProxyConfig, settings: OperatorSettings) -> Obj:
    ports = listener_ports(gateway)
    low = any(p.port < 1024 for p in ports)
    return {
        "name": ENVOY_CONTAINER,
        "image": settings.envoy_image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": ["--config-path", f"{c.ENVOY_CONFIG_DIR}/{c.ENVOY_CONFIG_KEY}", *proxy.args],
        # Referenced as $(POD_IP) etc. in the args: Kubernetes expands them.
        "env": [
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            _field_env("POD_IP", "status.podIP"),
        ],
        "ports": [
            *({"name": p.name, "containerPort": p.port, "protocol": "TCP"} for p in ports),
            {"name": "ready", "containerPort": proxy.ready_port, "protocol": "TCP"},
        ],
        # The kubelet sends SIGTERM (Envoy exits at once) only after this hook returns: once
        # the shutdown manager has drained Envoy's connections (infergate.envoy.drain).
        "lifecycle": {
            "preStop": {"httpGet": {"path": SHUTDOWN_PATH, "port": proxy.drain_port}},
        },
        # /ready is 200 once Envoy has its first config from the operator and is not
        # draining; no liveness probe on it: an Envoy waiting for the operator is alive.
        # 5 s, not the 1 s default: /ready is answered by Envoy's main thread (the admin
        # API), which xDS work delays; on a CPU-starved node three 1 s timeouts made the
        # one proxy unready, its Service had no endpoint, and clients were refused.
        "readinessProbe": {
            "httpGet": {"path": proxy.ready_path, "port": proxy.ready_port},
            "periodSeconds": 2,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {
                "cpu": settings.envoy_cpu_request,
                "memory": settings.envoy_memory_request,
            },
            "limits": {"memory": settings.envoy_memory_limit},
        },
        "securityContext": _security_context(low),
        "volumeMounts": [
            {"name": "envoy-config", "mountPath": c.ENVOY_CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def drain_options(proxy: ProxyConfig, settings: OperatorSettings) -> DrainOptions:
    """The shutdown manager's options: this pod's Envoy admin, the settings' timeout."""
    return DrainOptions(
        admin_url=f"http://127.0.0.1:{proxy.admin_port}",
        port=proxy.drain_port,
        min_drain_s=min(DrainOptions.min_drain_s, settings.drain_seconds),
        drain_timeout_s=settings.drain_seconds,
    )


def build_drain_container(proxy: ProxyConfig, settings: OperatorSettings) -> Obj:
    """The pod's shutdown manager (``infergate envoy-drain``, from the EPP image: Envoy's
    image has no shell for an ``exec`` hook, and a kubelet ``httpGet`` hook cannot POST to
    Envoy's admin API; infergate.envoy.drain says why, and who else does it this way). It
    gets SIGTERM when the pod is deleted, drains Envoy, and answers Envoy's preStop hook
    once the connections are gone."""
    return {
        "name": DRAIN_CONTAINER,
        "image": settings.epp_image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": drain_options(proxy, settings).argv(),
        "ports": [{"name": "drain", "containerPort": proxy.drain_port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": _security_context(False),
    }


def build_deployment(
    gateway: Obj, proxy: ProxyConfig, settings: OperatorSettings, config_hash: str
) -> Obj:
    low = any(p.port < 1024 for p in listener_ports(gateway))
    grace = math.ceil(settings.drain_seconds) + GRACE_MARGIN_S
    meta = _object_meta(gateway)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector_labels(gateway)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": {
                    "labels": meta["labels"],
                    "annotations": {
                        **_infrastructure(gateway, "annotations"),
                        c.ANNOTATION_CONFIG_HASH: config_hash,
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    # Longer than the shutdown manager's drain: the kubelet kills nothing
                    # that is still draining.
                    "terminationGracePeriodSeconds": grace,
                    "securityContext": _pod_security_context(low),
                    "containers": [
                        build_envoy_container(gateway, proxy, settings),
                        build_drain_container(proxy, settings),
                    ],
                    "volumes": [
                        {"name": "envoy-config", "configMap": {"name": meta["name"]}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }


def build_service(gateway: Obj, type_: str) -> Obj:
    """The Gateway's address: one port per listener port, straight to Envoy's."""
    ports = [
        {"name": p.name, "port": p.port, "targetPort": p.port, "protocol": "TCP"}
        for p in listener_ports(gateway)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _object_meta(gateway),
        "spec": {"type": type_, "selector": selector_labels(gateway), "ports": ports},
    }


def desired_objects(
    gateway: Obj, proxy: ProxyConfig, settings: OperatorSettings, default_service_type: str
) -> list[Obj]:
    """ConfigMap, Deployment, Service, in apply order, each stamped with its spec hash;
    the Deployment's pods roll when the bootstrap changes."""
    config_map = build_config_map(gateway, proxy)
    objects = [
        config_map,
        build_deployment(gateway, proxy, settings, digest(config_map["data"])),
        build_service(gateway, service_type(gateway, default_service_type)),
    ]
    return [with_spec_hash(o) for o in objects]


# -- reading the live objects back, for the Gateway's status ----------------------------


def gateway_addresses(service: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Where the Gateway is reached: its load balancer's addresses once it has them, else
    the Service's cluster IPs (reachable inside the cluster)."""
    if not service:
        return ()
    ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    found = tuple(
        str(i.get("ip") or i.get("hostname")) for i in ingress if i.get("ip") or i.get("hostname")
    )
    if found:
        return found
    spec = service.get("spec") or {}
    ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    return tuple(str(ip) for ip in ips if ip and ip != "None")


def deployment_available(deployment: Mapping[str, Any] | None) -> bool:
    """At least one Envoy pod is available and the Deployment reflects its latest spec."""
    if not deployment:
        return False
    status = deployment.get("status") or {}
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    current = int(status.get("observedGeneration") or 0) >= generation
    return current and int(status.get("availableReplicas") or 0) >= 1


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)
