"""A :class:`Snapshot` rendered as a static Envoy bootstrap, for ``envoy --mode validate``
and for running a Gateway's config without the ADS server (tests, debugging).

Envoy's validate mode checks static resources only, so EDS clusters become STATIC ones
holding their ClusterLoadAssignment and each listener gets its route table inline in
place of RDS: everything the ADS server would send is then checked by the real binary.
"""

from __future__ import annotations

import copy
from typing import Any

from infergate.envoy.bootstrap import socket_address
from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    Obj,
    Snapshot,
)

GATEWAY_RUNTIME: dict[str, Any] = {
    # Envoy refuses a regex whose RE2 program exceeds 100 steps unless told otherwise;
    # the translator bounds regexes itself (matches.REGEX_PROGRAM_LIMIT), so a Gateway's
    # Envoy must lift this or a route with a modest regex NACKs its whole route table.
    "re2.max_program_size.error_level": 1_000_000,
}
"""Runtime values every Gateway Envoy bootstrap needs (as a static layer)."""


def runtime_layer() -> dict[str, Any]:
    """``layered_runtime`` for a Gateway's Envoy bootstrap."""
    return {"layers": [{"name": "gateway", "static_layer": dict(GATEWAY_RUNTIME)}]}


def static_bootstrap(
    snapshot: Snapshot,
    node_id: str = "gateway",
    *,
    admin_port: int | None = None,
    ports: dict[int, int] | None = None,
) -> dict[str, Any]:
    """The snapshot's resources as ``static_resources``; ``ports`` remaps listener ports
    (e.g. 80 → a free port in tests)."""
    loads = {r["cluster_name"]: r for r in snapshot.resources.get(ENDPOINT_TYPE, ())}
    routes = {r["name"]: r for r in snapshot.resources.get(ROUTE_TYPE, ())}
    clusters = [_static_cluster(c, loads) for c in snapshot.resources.get(CLUSTER_TYPE, ())]
    listeners = [
        _inline_routes(listener, routes, ports or {})
        for listener in snapshot.resources.get(LISTENER_TYPE, ())
    ]
    bootstrap: dict[str, Any] = {
        "node": {"id": node_id, "cluster": node_id},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "layered_runtime": runtime_layer(),
    }
    if admin_port is not None:
        bootstrap["admin"] = {"address": socket_address("127.0.0.1", admin_port)}
    return bootstrap


def _static_cluster(cluster: Obj, loads: dict[str, Obj]) -> Obj:
    out = copy.deepcopy(cluster)
    if out.get("type") == "EDS":
        out.pop("eds_cluster_config", None)
        out["type"] = "STATIC"
        out["load_assignment"] = copy.deepcopy(
            loads.get(out["name"], {"cluster_name": out["name"], "endpoints": []})
        )
    return out


def _inline_routes(listener: Obj, routes: dict[str, Obj], ports: dict[int, int]) -> Obj:
    out = copy.deepcopy(listener)
    address = out["address"]["socket_address"]
    address["port_value"] = ports.get(address["port_value"], address["port_value"])
    for chain in out.get("filter_chains", []):
        for network_filter in chain.get("filters", []):
            hcm = network_filter.get("typed_config", {})
            rds = hcm.pop("rds", None)
            if rds is not None:
                name = rds["route_config_name"]
                table = copy.deepcopy(routes.get(name, {"name": name}))
                # As over RDS: a route may name a cluster that is (deliberately) absent.
                table["validate_clusters"] = False
                hcm["route_config"] = table
    return out
