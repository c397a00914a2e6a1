"""The seam between the Gateway API controller, its translator and its xDS server.

The operator collects the cluster's objects into :class:`ClusterObjects` (each one the
Kubernetes JSON body as the API server returns it), calls
``infergate.gateway.translate.translate`` and gets a :class:`Translation`: one
:class:`Snapshot` of Envoy v3 resources per Gateway (published on the ADS server under
the Gateway's node id) and the status each object should carry. Keeping both sides as
plain data means the translator is tested without a cluster and the xDS server without
Kubernetes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

Obj = dict[str, Any]
#: ``(namespace, name)`` of a namespaced object.
Key = tuple[str, str]

GATEWAY_CONTROLLER_NAME = "infergate.io/gateway-controller"
"""``GatewayClass.spec.controllerName`` this operator implements."""
GATEWAY_GROUP = "gateway.networking.k8s.io"

# Envoy v3 resource type URLs, in the order a state-of-the-world ADS server must make
# them take effect (make-before-break: a route never names a cluster Envoy lacks).
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
TYPE_ORDER = (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE)


def node_id(namespace: str, gateway: str) -> str:
    """The Envoy ``node.id`` of a Gateway's proxies (every replica shares it)."""
    return f"{namespace}/{gateway}"


@dataclass(frozen=True)
class ClusterObjects:
    """Everything the translator reads, as Kubernetes JSON bodies.

    ``gateway_classes`` and ``gateways`` may include objects of other controllers; the
    translator ignores them. ``pods`` are only needed for InferencePool endpoints (the
    pool's cluster learns them over EDS from the operator, so any EPP works)."""

    gateway_classes: tuple[Obj, ...] = ()
    gateways: tuple[Obj, ...] = ()
    http_routes: tuple[Obj, ...] = ()
    reference_grants: tuple[Obj, ...] = ()
    inference_pools: tuple[Obj, ...] = ()
    services: tuple[Obj, ...] = ()
    pods: tuple[Obj, ...] = ()
    namespaces: tuple[Obj, ...] = ()
    #: What the operator knows of each Gateway's proxies, for status: the addresses its
    #: Service exposes, and whether its Deployment is available and its Envoy acked the
    #: current snapshot (then the Gateway is Programmed).
    gateway_addresses: Mapping[Key, tuple[str, ...]] = field(default_factory=dict)
    gateway_programmed: Mapping[Key, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """One Gateway's Envoy config: v3 resources as JSON-shaped dicts (``@type`` inside
    ``typed_config`` as in a bootstrap), keyed by type URL, each resource with a ``name``
    (``cluster_name`` for a ClusterLoadAssignment)."""

    resources: Mapping[str, tuple[Obj, ...]]

    def version(self, type_url: str) -> str:
        """Content hash of one type's resources: equal content, equal version, so a
        resync that changes nothing sends Envoy nothing."""
        blob = json.dumps(self.resources.get(type_url, ()), sort_keys=True).encode()
        return xxhash.xxh64_hexdigest(blob)


@dataclass(frozen=True)
class Translation:
    """What the cluster should look like after one reconcile.

    * ``snapshots``: per Gateway (its key), the config its Envoy serves.
    * ``gateway_status`` / ``gateway_class_status``: the whole ``status`` to write.
    * ``route_parents``: per HTTPRoute, the ``status.parents`` entries this controller
      owns (entries of other controllers are kept by the writer).
    * ``pool_parents``: per InferencePool, the ``status.parents`` entries for Gateways of
      this controller (the operator's own standalone entry is written elsewhere).
    """

    snapshots: dict[Key, Snapshot] = field(default_factory=dict)
    gateway_status: dict[Key, Obj] = field(default_factory=dict)
    gateway_class_status: dict[str, Obj] = field(default_factory=dict)
    route_parents: dict[Key, list[Obj]] = field(default_factory=dict)
    pool_parents: dict[Key, list[Obj]] = field(default_factory=dict)
