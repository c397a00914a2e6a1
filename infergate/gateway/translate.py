"""The Gateway API translator: :class:`ClusterObjects` in, :class:`Translation` out.

``translate`` is a pure function (no I/O, no clock unless ``options.now`` is unset): the
operator calls it on every change with everything it watches, publishes the snapshots
on the ADS server and writes the statuses. It implements Gateway API v1 (standard
channel: GatewayClass, Gateway with HTTP listeners, HTTPRoute, ReferenceGrant) with
InferencePool (GIE v1) and core Service backends; the modules beside this one say what
each part covers. Bad input becomes status conditions, never an exception, and a request is never
sent to a pool its route did not name.

Output conventions:

* ``snapshots``: one per *accepted* Gateway of ours (all four resource types present,
  possibly empty); a Gateway that is not accepted gets none.
* ``route_parents`` / ``pool_parents``: an entry for *every* HTTPRoute / InferencePool
  handed in — empty when none of our Gateways is involved — so the writer drops stale
  entries of this controller.
* Resources may share sub-objects (one ext_proc override serves every route to its
  pool): treat a Translation as immutable.
* ``lastTransitionTime`` is carried over from each object's current status when a
  condition keeps its status, so an unchanged cluster translates to unchanged statuses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from infergate.gateway import conditions as c
from infergate.gateway.backends import INVALID_BACKEND_CLUSTER, Catalog
from infergate.gateway.listeners import (
    Listener,
    envoy_listener,
    gateway_conditions,
    gateway_problem,
    is_gateway_ref,
    listener_status,
    namespace_labels,
    parse_listeners,
    previous_listener_conditions,
    route_config_name,
    status_addresses,
)
from infergate.gateway.model import (
    GATEWAY_KIND,
    Meta,
    as_dict,
    as_list,
    as_str,
    index,
    meta,
)
from infergate.gateway.options import TranslateOptions
from infergate.gateway.routes import (
    Attachment,
    Route,
    Rule,
    attach,
    compile_route,
    parent_ref,
    route_conditions,
    route_configuration,
)
from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    GATEWAY_CONTROLLER_NAME,
    GATEWAY_GROUP,
    LISTENER_TYPE,
    ROUTE_TYPE,
    ClusterObjects,
    Key,
    Obj,
    Snapshot,
    Translation,
)

__all__ = ["TranslateOptions", "translate"]

log = logging.getLogger(__name__)

#: GIE caps ``status.parents`` at 32 entries.
MAX_POOL_PARENTS = 32


@dataclass
class _Gateway:
    """A Gateway of one of our GatewayClasses, as the translation goes."""

    obj: Obj
    meta: Meta
    listeners: list[Listener]
    problem: c.Condition | None
    attachments: list[Attachment] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return self.problem is None and any(x.usable for x in self.listeners)


#: Condition on an HTTPRoute parent entry whose match another route serves (an
#: implementation-specific type, so domain-prefixed as the Gateway API asks).
SHADOWED = "infergate.io/Shadowed"
SHADOWED_REASON = "ShadowedByPrecedence"


@dataclass
class _Run:
    """The state of one translation."""

    objects: ClusterObjects
    options: TranslateOptions
    now: str
    catalog: Catalog
    ns_labels: Any
    gateways: dict[Key, _Gateway] = field(default_factory=dict)
    #: pool → gateway → whether some route naming the pool is accepted there.
    pool_refs: dict[Key, dict[Key, bool]] = field(default_factory=dict)
    #: gateway → HTTPRoute → its matches another route serves there (route_configuration).
    shadowed: dict[Key, dict[Key, list[str]]] = field(default_factory=dict)
    out: Translation = field(default_factory=Translation)


def translate(objects: ClusterObjects, options: TranslateOptions | None = None) -> Translation:
    """The Envoy config of every Gateway of ours and the status of every object."""
    options = options or TranslateOptions()
    run = _Run(
        objects=objects,
        options=options,
        now=options.now or c.now_rfc3339(),
        catalog=Catalog(objects, options),
        ns_labels=namespace_labels(objects.namespaces),
    )
    classes = _gateway_classes(run)
    for raw in objects.gateways:
        _add_gateway(run, raw, classes)
    for obj in index(objects.http_routes).values():
        _route_parents(run, obj)
    for gateway in run.gateways.values():
        _finish_gateway(run, gateway)
    _shadowed_conditions(run)
    _pool_parents(run)
    return run.out


# --- GatewayClasses and Gateways --------------------------------------------------


def _gateway_classes(run: _Run) -> dict[str, bool]:
    """Our GatewayClasses (name → accepted), with their status."""
    ours: dict[str, bool] = {}
    for obj in run.objects.gateway_classes:
        spec = as_dict(as_dict(obj).get("spec"))
        m = meta(obj)
        if spec.get("controllerName") != GATEWAY_CONTROLLER_NAME or not m.name:
            continue
        if spec.get("parametersRef") is not None:
            accepted = c.false(c.ACCEPTED, c.INVALID_PARAMETERS, "parametersRef is not supported")
        else:
            accepted = c.true(c.ACCEPTED, c.ACCEPTED, "infergate implements this GatewayClass")
        conditions = [accepted, *_supported_version(run.options)]
        ours[m.name] = accepted.status == "True"
        previous = as_dict(as_dict(obj).get("status")).get("conditions")
        run.out.gateway_class_status[m.name] = {
            "conditions": c.render(conditions, previous, m.generation, run.now)
        }
    return ours


def _supported_version(options: TranslateOptions) -> list[c.Condition]:
    version = options.gateway_api_bundle_version
    if version is None:
        return []
    if version.startswith("v1."):
        return [c.true(c.SUPPORTED_VERSION, c.SUPPORTED_VERSION, f"Gateway API {version}")]
    message = f"Gateway API {version} is not supported (v1.x is); best effort"
    return [c.false(c.SUPPORTED_VERSION, c.UNSUPPORTED_VERSION, message)]


def _add_gateway(run: _Run, obj: Any, classes: dict[str, bool]) -> None:
    class_name = as_str(as_dict(as_dict(obj).get("spec")).get("gatewayClassName"))
    m = meta(obj)
    if class_name not in classes or not m.name:
        return
    problem = gateway_problem(obj)
    if not classes[class_name]:
        problem = c.false(c.ACCEPTED, c.INVALID, f"GatewayClass {class_name} is not accepted")
    run.gateways[m.key] = _Gateway(obj, m, parse_listeners(obj), problem)


def _finish_gateway(run: _Run, gateway: _Gateway) -> None:
    """Count attached routes, write the Gateway's status and build its snapshot."""
    for listener in gateway.listeners:
        routes = {a.route.meta.key for a in gateway.attachments if a.listener is listener}
        listener.attached = len(routes)
    programmed = bool(run.objects.gateway_programmed.get(gateway.meta.key, False))
    conditions = gateway_conditions(gateway.problem, gateway.listeners, programmed)
    accepted = conditions[0].status == "True"
    gen = gateway.meta.generation
    status = as_dict(gateway.obj.get("status"))
    run.out.gateway_status[gateway.meta.key] = {
        "conditions": c.render(conditions, status.get("conditions"), gen, run.now),
        "listeners": [
            listener_status(
                x,
                programmed and accepted,
                previous_listener_conditions(gateway.obj, x.name),
                gen,
                run.now,
            )
            for x in gateway.listeners
        ],
        "addresses": status_addresses(run.objects.gateway_addresses.get(gateway.meta.key)),
    }
    if accepted:
        run.out.snapshots[gateway.meta.key] = _snapshot(run, gateway)


def _snapshot(run: _Run, gateway: _Gateway) -> Snapshot:
    """The Gateway's Envoy resources: a listener and a route table per usable port, and
    every cluster (with its endpoints) those tables name."""
    usable = [x for x in gateway.listeners if x.usable]
    listeners, route_configs = [], []
    for port in sorted({x.port for x in usable}):
        on_port = [x for x in usable if x.port == port]
        attachments = [a for a in gateway.attachments if a.listener in on_port]
        name = route_config_name(port)
        listeners.append(envoy_listener(port, run.options))
        shadowed = run.shadowed.setdefault(gateway.meta.key, {})
        route_configs.append(
            route_configuration(name, port, on_port, attachments, run.options, shadowed)
        )
    names = sorted({n for rc in route_configs for n in _referenced_clusters(rc)})
    resources = [run.catalog.resources[n] for n in names if n in run.catalog.resources]
    return Snapshot(
        resources={
            CLUSTER_TYPE: tuple(r.cluster for r in resources),
            ENDPOINT_TYPE: tuple(r.load_assignment for r in resources),
            LISTENER_TYPE: tuple(listeners),
            ROUTE_TYPE: tuple(route_configs),
        }
    )


def _referenced_clusters(route_config: Obj) -> set[str]:
    """Every cluster a route table sends to, ext_proc EPP clusters included."""
    names: set[str] = set()
    for vhost in route_config["virtual_hosts"]:
        for route in vhost["routes"]:
            action = route.get("route", {})
            targets = [action, *action.get("weighted_clusters", {}).get("clusters", [])]
            for target in targets:
                names.add(target.get("cluster") or target.get("name") or "")
                per_filter = target.get("typed_per_filter_config") or route.get(
                    "typed_per_filter_config", {}
                )
                for config in per_filter.values():
                    grpc = config.get("overrides", {}).get("grpc_service", {})
                    names.add(grpc.get("envoy_grpc", {}).get("cluster_name", ""))
    names.discard("")
    names.discard(INVALID_BACKEND_CLUSTER)
    return names


# --- HTTPRoutes -------------------------------------------------------------------


def _route_parents(run: _Run, obj: Obj) -> None:
    """Attach one HTTPRoute to the Gateways of ours it names; its status.parents."""
    m = meta(obj)
    refs = [
        ref
        for ref in map(as_dict, as_list(as_dict(obj.get("spec")).get("parentRefs")))
        if is_gateway_ref(ref) and _gateway_key(ref, m.namespace) in run.gateways
    ]
    entries: list[Obj] = []
    run.out.route_parents[m.key] = entries
    if not refs:
        return
    route = _compile(obj, run)
    previous = as_list(as_dict(obj.get("status")).get("parents"))
    for ref in refs:
        echo = parent_ref(ref)
        if any(e["parentRef"] == echo for e in entries):
            continue
        gateway = run.gateways[_gateway_key(ref, m.namespace)]
        accepted, attachments = attach(
            route, ref, gateway.listeners, gateway.meta.namespace, run.ns_labels
        )
        gateway.attachments.extend(attachments)
        _note_pools(run, route, gateway.meta.key, accepted.status == "True")
        conditions = route_conditions(route, accepted)
        entries.append(
            {
                "parentRef": echo,
                "controllerName": GATEWAY_CONTROLLER_NAME,
                "conditions": c.render(
                    conditions, _previous_parent(previous, echo), m.generation, run.now
                ),
            }
        )


def _shadowed_conditions(run: _Run) -> None:
    """Tell a route's owner which of its matches another route serves on a Gateway.

    The Gateway API accepts both of two routes with the same match and gives the match
    to the older (then the first by namespace/name); nothing in its standard conditions
    says the other one lost. infergate adds ``infergate.io/Shadowed`` (True, reason
    ``ShadowedByPrecedence``) to that route's parent entry, naming the route that serves
    the match; the entry stays Accepted, as the spec requires."""
    routes = index(run.objects.http_routes)
    for gateway_key, by_route in run.shadowed.items():
        for route_key, messages in by_route.items():
            previous = as_list(as_dict(routes.get(route_key, {}).get("status")).get("parents"))
            for entry in run.out.route_parents.get(route_key, []):
                ref = entry["parentRef"]
                if _gateway_key(ref, route_key[0]) != gateway_key:
                    continue
                cond = c.true(SHADOWED, SHADOWED_REASON, "; ".join(sorted(set(messages))))
                before = _previous_parent(previous, ref)
                gen = meta(routes.get(route_key, {})).generation
                entry["conditions"] = [
                    *entry["conditions"],
                    *c.render([cond], before, gen, run.now),
                ]


def _compile(obj: Obj, run: _Run) -> Route:
    """compile_route, with a last-resort guard: one malformed object must not stop the
    translation of every Gateway (the fuzz tests assert this guard never fires)."""
    try:
        return compile_route(obj, run.catalog)
    except Exception as error:  # pragma: no cover - a translator bug, reported as status
        log.exception("translating HTTPRoute %s/%s failed", *meta(obj).key)
        broken = Rule(0, [], [], problem=f"internal error: {error}")
        return Route(obj, meta(obj), [], False, [broken])


def _gateway_key(ref: dict[str, Any], route_namespace: str) -> Key:
    return (as_str(ref.get("namespace")) or route_namespace, as_str(ref.get("name")))


def _previous_parent(previous: list[Any], echo: Obj) -> Any:
    for entry in map(as_dict, previous):
        if (
            entry.get("controllerName") == GATEWAY_CONTROLLER_NAME
            and entry.get("parentRef") == echo
        ):
            return entry.get("conditions")
    return None


def _note_pools(run: _Run, route: Route, gateway: Key, accepted: bool) -> None:
    """Remember which pools this route routes to through ``gateway``."""
    for rule in route.rules:
        for backend in rule.backends:
            if backend.pool is not None:
                seen = run.pool_refs.setdefault(backend.pool, {})
                seen[gateway] = seen.get(gateway, False) or accepted


# --- InferencePools ---------------------------------------------------------------


def _pool_parents(run: _Run) -> None:
    """Per InferencePool, one status.parents entry per Gateway of ours routing to it."""
    for key, obj in index(run.objects.inference_pools).items():
        entries = []
        pool = run.catalog.pool(key)
        previous = as_list(as_dict(obj.get("status")).get("parents"))
        for gateway, accepted in sorted(run.pool_refs.get(key, {}).items()):
            if pool is None:
                continue
            conditions = pool.conditions(run.options)
            if not accepted:
                message = "no HTTPRoute naming this pool is accepted by the gateway"
                conditions[0] = c.false(c.ACCEPTED, c.HTTPROUTE_NOT_ACCEPTED, message)
            ref = {
                "group": GATEWAY_GROUP,
                "kind": GATEWAY_KIND,
                "namespace": gateway[0],
                "name": gateway[1],
            }
            entries.append(
                {
                    "parentRef": ref,
                    "controllerName": GATEWAY_CONTROLLER_NAME,
                    "conditions": c.render(
                        conditions, _previous_pool_parent(previous, ref), pool.generation, run.now
                    ),
                }
            )
        run.out.pool_parents[key] = entries[:MAX_POOL_PARENTS]


def _previous_pool_parent(previous: list[Any], ref: Obj) -> Any:
    for entry in map(as_dict, previous):
        parent = as_dict(entry.get("parentRef"))
        if (
            entry.get("controllerName") == GATEWAY_CONTROLLER_NAME
            and parent.get("name") == ref["name"]
            and parent.get("namespace") == ref["namespace"]
        ):
            return entry.get("conditions")
    return None
