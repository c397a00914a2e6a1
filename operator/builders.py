"""Pure functions from a pool to the Kubernetes objects that serve it.

No API calls here: the handlers fetch what they need, call these, and apply the result
with server-side apply. Every object is owned by the pool (deleting the pool deletes
it) and carries a hash of itself so a resync can tell "already applied" apart from
"changed" without a write.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from infergate.epp.options import EPP_PORTS, EppOptions

from infergate.operator import constants as c
from infergate.operator.pool import PoolSpec
from infergate.operator.settings import OperatorSettings

Obj = dict[str, Any]

EPP_CONTAINER = "epp"
ENVOY_CONTAINER = "envoy"
RUN_AS_USER = 65532  # the distroless "nonroot" uid, also used by our images
#: A deleted EPP pod keeps serving this long before its SIGTERM (a preStop ``sleep``, no
#: binary needed): the operator's EDS and kube-proxy drop it meanwhile, so no proxy opens a
#: stream to it after it stops accepting. On the busy node the operator's view of a pod
#: change (watch, then the Gateways' EDS) lagged up to 10 s: 5 s was too short.
EPP_PRESTOP_S = 15
#: On SIGTERM an EPP answers NOT_SERVING to health checks this long before it stops
#: accepting (--shutdown-delay-s): a Gateway's Envoy, checking every second, stops opening
#: streams to it even when its EDS still lists it (the operator lagged 21 s on the node).
EPP_WITHDRAW_S = 5
#: The EPP Deployment's ``minReadySeconds``: a new EPP is in the Gateways' EDS, and
#: health-checked by their Envoys, before the old one is deleted (same lag).
EPP_MIN_READY_S = 10


def digest(value: Any) -> str:
    """A short, stable hash of JSON-able data."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def selector_labels(pool: PoolSpec) -> dict[str, str]:
    """Labels that pick this pool's EPP pods (immutable once a Deployment exists)."""
    return {c.LABEL_NAME: "infergate-epp", c.LABEL_INSTANCE: pool.name}


def common_labels(pool: PoolSpec) -> dict[str, str]:
    return {
        **selector_labels(pool),
        c.LABEL_COMPONENT: "endpoint-picker",
        c.LABEL_MANAGED_BY: "infergate-operator",
        c.LABEL_POOL: pool.name,
    }


def owner_reference(pool: PoolSpec) -> Obj:
    return {
        "apiVersion": c.POOL_API_VERSION,
        "kind": c.POOL_KIND,
        "name": pool.name,
        "uid": pool.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(pool: PoolSpec, name: str) -> Obj:
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": common_labels(pool),
        "ownerReferences": [owner_reference(pool)],
    }


def with_spec_hash(obj: Obj) -> Obj:
    """Stamp ``obj`` with the hash of its own content (annotation ANNOTATION_SPEC_HASH)."""
    stamped = copy.deepcopy(obj)
    annotations = stamped["metadata"].setdefault("annotations", {})
    annotations.pop(c.ANNOTATION_SPEC_HASH, None)
    annotations[c.ANNOTATION_SPEC_HASH] = digest(stamped)
    return stamped


def envoy_config_name(pool: PoolSpec) -> str:
    return f"{pool.picker_name}-envoy"


def tls_secret_name(pool: PoolSpec) -> str:
    return f"{pool.picker_name}-tls"


def tls_server_names(pool: PoolSpec) -> list[str]:
    """DNS names the EPP's certificate carries beside ``infergate-epp`` (its Service's)."""
    service = f"{pool.picker_name}.{pool.namespace}.svc"
    return [pool.picker_name, service, f"{service}.cluster.local"]


def encode_tls_bundle(bundle: dict[str, bytes]) -> dict[str, str]:
    """A bundle of ``infergate.epp.server.tls.mutual_tls_bundle`` as a Secret's ``data``."""
    return {name: base64.b64encode(value).decode() for name, value in sorted(bundle.items())}


def build_tls_secret(pool: PoolSpec, tls_data: dict[str, str]) -> Obj:
    """The pool's TLS material (one CA's certificate, the EPP's server pair, the
    gateway's client pair; ``tls_data`` is the Secret's base64 ``data``). The reconciler
    creates it once and never reads or rewrites it (the operator may create Secrets,
    not read them); it lives as long as the pool."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(pool, tls_secret_name(pool)),
        "type": "Opaque",
        "data": dict(tls_data),
    }


def epp_options(pool: PoolSpec, tls: bool = False) -> EppOptions:
    """The pool's EPP: its pool, the mounted config, the fixed ports the probes and
    Services name, TLS on (GIE's default: gateways, Istio's sidecar included, reach
    ext-proc over TLS). With the pool's TLS Secret the EPP serves its certificate and
    requires the standalone Envoy's client certificate (mutual TLS); without, a
    self-signed one."""
    from infergate.epp.server.tls import CA_CERT

    tls_dir = Path(c.EPP_TLS_DIR)
    return EppOptions(
        pool_name=pool.name,
        pool_namespace=pool.namespace,
        config_file=Path(f"{c.EPP_CONFIG_DIR}/{c.EPP_CONFIG_KEY}"),
        grpc_port=c.EPP_GRPC_PORT,
        grpc_health_port=c.EPP_HEALTH_PORT,
        metrics_port=c.EPP_METRICS_PORT,
        completion_events_port=pool.completion_events_port,
        secure_serving=True,
        cert_path=tls_dir if tls else None,
        client_ca_file=tls_dir / CA_CERT if tls and pool.standalone_envoy else None,
    )


#: Written even at their defaults: a pod spec names its pool namespace and its ports.
_EPP_ALWAYS = ("pool_namespace", *EPP_PORTS)


def build_config_map(pool: PoolSpec, epp_config: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(pool, pool.picker_name),
        "data": {c.EPP_CONFIG_KEY: epp_config},
    }


def build_service_account(pool: PoolSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(pool, pool.picker_name),
        "automountServiceAccountToken": True,
    }


def build_role(pool: PoolSpec) -> Obj:
    """Least privilege for one EPP: read its pods, its pool, and the pool's policy objects."""
    read = ["get", "list", "watch"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(pool, pool.picker_name),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
            {"apiGroups": [c.POOL_GROUP], "resources": [c.POOL_PLURAL], "verbs": read},
            {
                "apiGroups": [c.X_GROUP],
                "resources": [c.OBJECTIVE_PLURAL, c.REWRITE_PLURAL],
                "verbs": read,
            },
        ],
    }


def build_role_binding(pool: PoolSpec) -> Obj:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(pool, pool.picker_name),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": pool.picker_name,
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": pool.picker_name, "namespace": pool.namespace}
        ],
    }


def _restricted_security_context() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def build_epp_container(pool: PoolSpec, settings: OperatorSettings, tls: bool = False) -> Obj:
    options = replace(
        epp_options(pool, tls),
        shutdown_delay_s=EPP_WITHDRAW_S,
        shutdown_grace_s=settings.drain_seconds,
    )
    args = [*options.argv(always=_EPP_ALWAYS), *settings.extra_epp_args]
    # The EPP's gRPC health server answers "readiness" (SERVING once it knows endpoints)
    # and "liveness" (SERVING while the process works): a pool without ready model
    # servers makes the EPP unready, never restarts it. The startup probe holds liveness
    # off until the process first answers (up to 2 s x 30): on a loaded node a starting
    # EPP missed a 1 s liveness check 5 s in and the kubelet killed it mid-start.
    readiness = {"grpc": {"port": c.EPP_HEALTH_PORT, "service": "readiness"}}
    liveness = {"grpc": {"port": c.EPP_HEALTH_PORT, "service": "liveness"}}
    return {
        "name": EPP_CONTAINER,
        "image": pool.epp_image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": args,
        "ports": [
            {"name": "grpc", "containerPort": c.EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": c.EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": c.EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
            {"name": "INFERGATE_LOG_LEVEL", "value": settings.epp_log_level},
            *_engine_api_key_env(pool),
        ],
        # A deleted EPP pod serves on for EPP_PRESTOP_S while the Gateways' EDS and the
        # Service drop it; then SIGTERM: it stops accepting, sends GOAWAY and gives the
        # streams in flight up to settings.drain_seconds (--shutdown-grace-s).
        "lifecycle": {"preStop": {"sleep": {"seconds": EPP_PRESTOP_S}}},
        "readinessProbe": {**readiness, "periodSeconds": 2, "failureThreshold": 3},
        "startupProbe": {**liveness, "periodSeconds": 2, "failureThreshold": 30},
        "livenessProbe": {**liveness, "periodSeconds": 10, "timeoutSeconds": 3},
        "resources": {
            "requests": {"cpu": settings.epp_cpu_request, "memory": settings.epp_memory_request},
            "limits": {"memory": settings.epp_memory_limit},
        },
        "securityContext": _restricted_security_context(),
        "volumeMounts": [
            {"name": "epp-config", "mountPath": c.EPP_CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *_tls_mount(tls),
        ],
    }


def _tls_mount(tls: bool) -> list[Obj]:
    return [{"name": "tls", "mountPath": c.EPP_TLS_DIR, "readOnly": True}] if tls else []


def _engine_api_key_env(pool: PoolSpec) -> list[Obj]:
    """The engines' API key from the pool's Secret, never inlined in the Deployment."""
    if pool.engine_api_key_secret is None:
        return []
    name, key = pool.engine_api_key_secret
    ref = {"secretKeyRef": {"name": name, "key": key}}
    return [{"name": c.EPP_ENGINE_API_KEY_ENV, "valueFrom": ref}]


def build_envoy_container(pool: PoolSpec, settings: OperatorSettings, tls: bool = False) -> Obj:
    """The standalone-mode proxy: Envoy in the EPP pod, talking ext-proc over loopback."""
    return {
        "name": ENVOY_CONTAINER,
        "image": settings.envoy_image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": [
            "--config-path",
            f"{c.ENVOY_CONFIG_DIR}/{c.ENVOY_CONFIG_KEY}",
            "--log-level",
            "warn",
            "--base-id",
            "1",
        ],
        "ports": [{"name": "http", "containerPort": c.ENVOY_LISTEN_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": c.ENVOY_LISTEN_PORT}, "periodSeconds": 2},
        "livenessProbe": {
            "tcpSocket": {"port": c.ENVOY_LISTEN_PORT},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
        },
        "resources": {
            "requests": {
                "cpu": settings.envoy_cpu_request,
                "memory": settings.envoy_memory_request,
            },
            "limits": {"memory": settings.envoy_memory_limit},
        },
        "securityContext": _restricted_security_context(),
        "volumeMounts": [
            {"name": "envoy-config", "mountPath": c.ENVOY_CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *_tls_mount(tls),
        ],
    }


def build_deployment(
    pool: PoolSpec,
    settings: OperatorSettings,
    config_hash: str,
    tls: bool = False,
) -> Obj:
    containers = [build_epp_container(pool, settings, tls)]
    volumes: list[Obj] = [
        {"name": "epp-config", "configMap": {"name": pool.picker_name}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    if tls:
        secret = {"secretName": tls_secret_name(pool), "defaultMode": 0o440}
        volumes.append({"name": "tls", "secret": secret})
    if pool.standalone_envoy:
        containers.append(build_envoy_container(pool, settings, tls))
        volumes.append({"name": "envoy-config", "configMap": {"name": envoy_config_name(pool)}})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, pool.picker_name),
        "spec": {
            "replicas": pool.epp_replicas,
            "selector": {"matchLabels": selector_labels(pool)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            # A new EPP counts as available (and an old one is deleted) only after this
            # long Ready: a Gateway's Envoy health-checks a new EPP before it sends to it,
            # and on the node, without this, the new one came and the old one went in one
            # EDS update: 1 s of "no healthy upstream" (500s) until the first check passed.
            "minReadySeconds": EPP_MIN_READY_S,
            "template": {
                "metadata": {
                    "labels": common_labels(pool),
                    "annotations": {c.ANNOTATION_CONFIG_HASH: config_hash},
                },
                "spec": {
                    "serviceAccountName": pool.picker_name,
                    # The preStop wait and the streams' drain, with a margin to exit.
                    "terminationGracePeriodSeconds": EPP_PRESTOP_S
                    + EPP_WITHDRAW_S
                    + math.ceil(settings.drain_seconds)
                    + 15,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS_USER,
                        "runAsGroup": RUN_AS_USER,
                        "fsGroup": RUN_AS_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": containers,
                    "volumes": volumes,
                },
            },
        },
    }


def build_service(pool: PoolSpec) -> Obj:
    """The Service the pool's endpointPickerRef names: ext-proc gRPC at the ref's port."""
    assert pool.picker_port is not None, "a Service picker always has a port"
    ports: list[Obj] = [
        {
            "name": "grpc-ext-proc",
            "port": pool.picker_port,
            "targetPort": c.EPP_GRPC_PORT,
            "protocol": "TCP",
            "appProtocol": "http2",
        },
        {
            "name": "http-metrics",
            "port": c.EPP_METRICS_PORT,
            "targetPort": c.EPP_METRICS_PORT,
            "protocol": "TCP",
        },
    ]
    if pool.standalone_envoy:
        ports.append(
            {
                "name": "http",
                "port": c.ENVOY_LISTEN_PORT,
                "targetPort": c.ENVOY_LISTEN_PORT,
                "protocol": "TCP",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, pool.picker_name),
        "spec": {"type": "ClusterIP", "selector": selector_labels(pool), "ports": ports},
    }


def replicas_service_name(pool: PoolSpec) -> str:
    return f"{pool.picker_name}-replicas"


def build_replicas_service(pool: PoolSpec) -> Obj | None:
    """A headless Service over the ready EPP pods (standalone Envoy, 2+ replicas): its DNS
    name resolves to every replica, so each sidecar Envoy's ext_proc cluster has them all
    and a request goes to another replica when its own pod's EPP is down."""
    if not (pool.standalone_envoy and pool.epp_replicas > 1):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, replicas_service_name(pool)),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(pool),
            "ports": [
                {
                    "name": "grpc-ext-proc",
                    "port": c.EPP_GRPC_PORT,
                    "targetPort": c.EPP_GRPC_PORT,
                    "protocol": "TCP",
                    "appProtocol": "http2",
                }
            ],
        },
    }


def build_pdb(pool: PoolSpec) -> Obj | None:
    """Keep one EPP up through voluntary disruptions; only meaningful with 2+ replicas."""
    if pool.epp_replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(pool, pool.picker_name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(pool)}},
    }


def build_envoy_bootstrap(
    pool: PoolSpec, settings: OperatorSettings | None = None, mutual_tls: bool = False
) -> Obj:
    """Envoy's bootstrap for the sidecar: ext-proc and EDS from the EPP on loopback,
    over mutual TLS with the pool's Secret (``mutual_tls``), its heap bounded below the
    container's memory limit."""
    from infergate.epp.server import tls

    from infergate.envoy.bootstrap import EnvoyConfig, EppMutualTls, build_envoy_config

    settings = settings or OperatorSettings()
    mtls = None
    if mutual_tls:
        mtls = EppMutualTls(
            ca_file=f"{c.EPP_TLS_DIR}/{tls.CA_CERT}",
            cert_file=f"{c.EPP_TLS_DIR}/{tls.CLIENT_CERT}",
            key_file=f"{c.EPP_TLS_DIR}/{tls.CLIENT_KEY}",
            server_name=tls.EPP_SERVER_NAME,
        )

    return build_envoy_config(
        EnvoyConfig(
            listen_port=c.ENVOY_LISTEN_PORT,
            epp_address="127.0.0.1",
            epp_port=c.EPP_GRPC_PORT,
            failure_mode_allow=pool.failure_mode == "FailOpen",
            admin_port=c.ENVOY_ADMIN_PORT,
            listen_address="0.0.0.0",
            epp_tls=True,  # the EPP container runs with --secure-serving
            epp_mtls=mtls,
            max_heap_bytes=settings.envoy_max_heap_bytes,
            # `observer` unless the pool's engines publish completion records (parse_pool).
            response_accounting=pool.response_accounting,
            # Every replica (the headless Service's DNS), beside the pod's own EPP.
            epp_replicas=(
                ((f"{replicas_service_name(pool)}.{pool.namespace}.svc", c.EPP_GRPC_PORT),)
                if build_replicas_service(pool) is not None
                else ()
            ),
        )
    )


def build_envoy_config_map(
    pool: PoolSpec, settings: OperatorSettings | None = None, mutual_tls: bool = False
) -> Obj:
    bootstrap = yaml.safe_dump(build_envoy_bootstrap(pool, settings, mutual_tls), sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(pool, envoy_config_name(pool)),
        "data": {c.ENVOY_CONFIG_KEY: bootstrap},
    }


def desired_objects(
    pool: PoolSpec,
    settings: OperatorSettings,
    epp_config: str,
    tls: bool = False,
) -> list[Obj]:
    """Everything one pool needs, in apply order, each stamped with its spec hash.

    ``tls``: the pool's TLS Secret (:func:`build_tls_secret`) exists, created by the
    reconciler; without it the EPP serves a self-signed certificate, unverified."""
    config_map = build_config_map(pool, epp_config)
    objects: list[Obj] = [config_map]
    if pool.standalone_envoy:
        objects.append(build_envoy_config_map(pool, settings, tls))
    config_hash = digest([o["data"] for o in objects])
    objects += [
        build_service_account(pool),
        build_role(pool),
        build_role_binding(pool),
        build_deployment(pool, settings, config_hash, tls),
        build_service(pool),
    ]
    replicas_service = build_replicas_service(pool)
    if replicas_service is not None:
        objects.append(replicas_service)
    pdb = build_pdb(pool)
    if pdb is not None:
        objects.append(pdb)
    return [with_spec_hash(o) for o in objects]
