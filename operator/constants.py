"""Names shared by the operator, its builders, the chart and the tests."""

from __future__ import annotations

from infergate.epp.options import ENGINE_API_KEY_ENV

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
POOL_KIND = "InferencePool"
POOL_API_VERSION = f"{POOL_GROUP}/{POOL_VERSION}"

X_GROUP = "inference.networking.x-k8s.io"
X_VERSION = "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"
REWRITE_PLURAL = "inferencemodelrewrites"

#: Server-side-apply field manager; everything the operator writes is owned by it.
FIELD_MANAGER = "infergate"
#: ``status.parents[].controllerName`` of the entry this operator writes.
CONTROLLER_NAME = "infergate.io/operator"
#: The ``parentRef`` of that entry. GIE keeps one entry per Gateway; a pool that no
#: Gateway references (standalone mode, or before a Gateway picks it up) still needs
#: honest status, so the operator reports under its own parent, never as a Gateway.
OPERATOR_PARENT_REF = {"group": "infergate.io", "kind": "Operator", "name": "infergate"}

# Pool annotations (the operator's knobs, per pool).
ANNOTATION_EPP_CONFIG = "infergate.io/epp-config"  # ConfigMap name holding the user's config
ANNOTATION_EPP_CONFIG_KEY = "infergate.io/epp-config-key"  # key in it (default config.yaml)
ANNOTATION_STANDALONE_ENVOY = "infergate.io/standalone-envoy"  # "true": Envoy sidecar
ANNOTATION_EPP_REPLICAS = "infergate.io/epp-replicas"  # EPP Deployment replicas
ANNOTATION_EPP_IMAGE = "infergate.io/epp-image"  # per-pool EPP image override
# Prefill/decode disaggregation: "prefill-decode" generates the P/D EndpointPickerConfig
# (engines' roles come from their pods' llm-d.ai/role labels); the threshold is the
# uncached prompt tokens above which a request is split (default 256).
ANNOTATION_DISAGGREGATION = "infergate.io/disaggregation"
ANNOTATION_PD_THRESHOLD = "infergate.io/pd-threshold"
DISAGGREGATION_PD = "prefill-decode"
# The pool's engines publish completion records on this port (infergate engines run with
# --completion-events-port): the EPP subscribes to it, and a standalone Envoy then
# defaults to `engine` response accounting (no response body through the EPP).
ANNOTATION_COMPLETION_EVENTS_PORT = "infergate.io/completion-events-port"
# How the standalone Envoy lets the EPP learn a response's end and usage; one of
# RESPONSE_ACCOUNTING (build_envoy_config's values). Default: `engine` when the pool
# names a completion-events port, else `observer` (works with any engine, vLLM included).
ANNOTATION_RESPONSE_ACCOUNTING = "infergate.io/response-accounting"
RESPONSE_ACCOUNTING = ("engine", "observer", "body", "none")
# The engines' --api-key, for the EPP's calls to their /tokenize: "NAME" or "NAME/KEY",
# a Secret in the pool's namespace (key default ENGINE_API_KEY_SECRET_KEY). The EPP gets it
# as the environment variable EPP_ENGINE_API_KEY_ENV (a secretKeyRef), which the
# precise-prefix-cache-scorer reads by default.
ANNOTATION_ENGINE_API_KEY_SECRET = "infergate.io/engine-api-key-secret"
ENGINE_API_KEY_SECRET_KEY = "api-key"
EPP_ENGINE_API_KEY_ENV = ENGINE_API_KEY_ENV

# Annotations and labels the operator puts on what it owns.
ANNOTATION_SPEC_HASH = "infergate.io/spec-hash"  # hash of the desired object, for no-op resyncs
ANNOTATION_CONFIG_HASH = "infergate.io/config-hash"  # rolls the EPP pods when configs change
LABEL_POOL = "infergate.io/pool"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"

# EPP ports (DESIGN.md).
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
ENVOY_LISTEN_PORT = 8081
ENVOY_ADMIN_PORT = 19000

EPP_CONFIG_KEY = "config.yaml"
EPP_CONFIG_DIR = "/etc/infergate/epp"
EPP_TLS_DIR = "/etc/infergate/tls"
"""The pool's TLS Secret, mounted in the EPP and the standalone Envoy containers."""
ENVOY_CONFIG_KEY = "envoy.yaml"
ENVOY_CONFIG_DIR = "/etc/envoy"

# Condition types and reasons written to status.parents[].conditions.
ACCEPTED = "Accepted"
RESOLVED_REFS = "ResolvedRefs"
READY = "Ready"
