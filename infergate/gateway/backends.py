"""HTTPRoute backendRefs: Services and InferencePools, their clusters and endpoints.

Every upstream is an EDS cluster fed over ADS from the operator's view of the pods: no
DNS, no ClusterIP, so it works wherever pods have IPs (the project's loopback control
plane included). Cluster names say what they are:

* ``pool/<ns>/<name>``: an InferencePool's pods × targetPorts, balanced with Envoy's
  ``override_host`` policy keyed on GIE's ``x-gateway-destination-endpoint`` (the EPP's
  pick and fallback list), least-request without a pick — as the standalone bootstrap;
* ``epp/<ns>/<service>/<port>``: the pods behind a pool's ``endpointPickerRef`` Service,
  over HTTP/2 (TLS per :class:`TranslateOptions`), health-checked;
* ``service/<ns>/<name>/<port>``: the ready pods behind a core Service port.

A pool cluster only ever holds that pool's pods, and a route reaches it only through a
backendRef naming that pool: an EPP answer can pick among them, never outside them.
A backendRef that cannot be used names :data:`INVALID_BACKEND_CLUSTER`, a cluster that
never exists, so Envoy answers its share of requests with 500 as the spec asks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infergate.envoy import bootstrap as envoy
from infergate.gateway import conditions as c
from infergate.gateway.model import (
    CORE_GROUP,
    HTTPROUTE_KIND,
    POOL_GROUP,
    POOL_KIND,
    SERVICE_KIND,
    as_dict,
    as_int,
    as_list,
    as_str,
    index,
    meta,
    named_container_port,
    pod_serving_ip,
    ref_permitted,
    str_map,
    valid_port,
)
from infergate.gateway.options import TranslateOptions
from infergate.gateway.types import ClusterObjects, Key, Obj

INVALID_BACKEND_CLUSTER = "invalid-backend"
"""Named by invalid backendRefs in weighted clusters; never defined, so Envoy answers
with the route's ``cluster_not_found_response_code`` (500)."""
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
H2C = ("kubernetes.io/h2c", "h2c")
_MAX_WEIGHT = 1_000_000


@dataclass(frozen=True)
class Backend:
    """One backendRef as the route uses it.

    ``cluster`` None means "answer 500 for this share"; ``problem`` is the
    ``(reason, message)`` the route's ResolvedRefs reports; ``pool`` names an
    InferencePool the ref resolved to (for the pool's status) even when its EPP is
    unusable; ``ext_proc`` is the per-route ext_proc config that points the filter at
    the pool's EPP."""

    weight: int
    cluster: str | None
    problem: tuple[str, str] | None = None
    pool: Key | None = None
    ext_proc: Obj | None = None
    filters: tuple[Any, ...] = ()

    @property
    def served(self) -> bool:
        """Routed through an EPP: the served endpoint goes back to it."""
        return self.ext_proc is not None


@dataclass
class Pool:
    """An InferencePool and what its endpointPickerRef resolved to."""

    key: Key
    generation: int
    cluster: str
    http2: bool | None
    epp_state: str  # "ok" | "missing" | "invalid"
    epp_message: str = ""
    epp_cluster: str | None = None
    epp_authority: str = ""
    failure_mode_allow: bool = False

    def conditions(self, options: TranslateOptions) -> list[c.Condition]:
        """The pool's Accepted and ResolvedRefs for a Gateway that routes to it."""
        if self.epp_state == "missing" and options.pool_without_epp == "reject":
            accepted = c.false(c.ACCEPTED, c.EPP_REF_MISSING, "endpointPickerRef is required")
        elif self.epp_state == "missing":
            accepted = c.true(
                c.ACCEPTED,
                c.ACCEPTED,
                "no endpointPickerRef: requests are balanced least-request over the pool",
            )
        else:
            accepted = c.true(c.ACCEPTED, c.ACCEPTED, "InferencePool is a backend of this gateway")
        if self.epp_state == "invalid":
            resolved = c.false(c.RESOLVED_REFS, c.INVALID_EXTENSION_REF, self.epp_message)
        else:
            resolved = c.true(c.RESOLVED_REFS, c.RESOLVED_REFS, "references resolved")
        return [accepted, resolved]


@dataclass(frozen=True)
class _ReadyPod:
    ip: str
    labels: Mapping[str, str]
    obj: Obj
    terminating: bool = False


@dataclass
class Resources:
    """A cluster and its ClusterLoadAssignment (every cluster here is EDS)."""

    cluster: Obj
    load_assignment: Obj


@dataclass
class Catalog:
    """The cluster's backends, resolved lazily and cached for one translation."""

    objects: ClusterObjects
    options: TranslateOptions
    resources: dict[str, Resources] = field(default_factory=dict)
    _pools: dict[Key, Pool | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.services = index(self.objects.services)
        self.pool_objects = index(self.objects.inference_pools)
        # Serving pods, read once, indexed by (namespace, label, value): selecting a pool's
        # or a Service's pods costs the size of its smallest label bucket, not the fleet.
        self._by_label: dict[tuple[str, str, str], list[_ReadyPod]] = {}
        for pod in self.objects.pods:
            serving = pod_serving_ip(pod)
            if serving is None:
                continue
            m = meta(pod)
            ready = _ReadyPod(serving[0], m.labels, pod, terminating=serving[1])
            for label, value in m.labels.items():
                self._by_label.setdefault((m.namespace, label, value), []).append(ready)

    def _select(
        self, namespace: str, selector: dict[str, str], *, terminating: bool = False
    ) -> list[_ReadyPod]:
        """Ready pods of ``namespace`` whose labels include all of ``selector`` (an empty
        selector selects nothing: neither a pool nor a Service selects a whole namespace);
        with ``terminating``, terminating pods that still pass readiness too."""
        if not selector:
            return []
        buckets = [self._by_label.get((namespace, k, v), []) for k, v in selector.items()]
        smallest = min(buckets, key=len)
        return [
            p
            for p in smallest
            if (terminating or not p.terminating)
            and all(p.labels.get(k) == v for k, v in selector.items())
        ]

    # --- backendRefs -------------------------------------------------------------

    def resolve(self, route_namespace: str, ref: Any) -> Backend:
        """What one HTTPRoute backendRef routes to (or why it cannot)."""
        ref = as_dict(ref)
        weight = _weight(ref)
        filters = tuple(as_list(ref.get("filters")))
        group = as_str(ref.get("group"), CORE_GROUP)
        kind = as_str(ref.get("kind"), SERVICE_KIND)
        namespace = as_str(ref.get("namespace")) or route_namespace
        name = as_str(ref.get("name"))
        if (group, kind) not in ((CORE_GROUP, SERVICE_KIND), (POOL_GROUP, POOL_KIND)):
            return _invalid(weight, c.INVALID_KIND, f"unsupported backend kind {group}/{kind}")
        if not ref_permitted(
            self.objects.reference_grants,
            from_kind=HTTPROUTE_KIND,
            from_namespace=route_namespace,
            to_group=group,
            to_kind=kind,
            to_namespace=namespace,
            to_name=name,
        ):
            message = f"no ReferenceGrant allows a reference to {kind} {namespace}/{name}"
            return _invalid(weight, c.REF_NOT_PERMITTED, message)
        if kind == POOL_KIND:
            return self._pool_backend(weight, (namespace, name), filters)
        return self._service_backend(weight, (namespace, name), as_int(ref.get("port")), filters)

    def _service_backend(
        self, weight: int, key: Key, port: int | None, filters: tuple[Any, ...]
    ) -> Backend:
        service = self.services.get(key)
        if service is None:
            return _invalid(weight, c.BACKEND_NOT_FOUND, f"Service {key[0]}/{key[1]} not found")
        if port is None:
            return _invalid(weight, c.BACKEND_NOT_FOUND, "a Service backendRef needs a port")
        spec = as_dict(service.get("spec"))
        if spec.get("type") == "ExternalName":
            return _invalid(weight, c.INVALID_KIND, "ExternalName Services are not supported")
        service_port = _service_port(spec, port)
        if service_port is None:
            message = f"Service {key[0]}/{key[1]} has no TCP port {port}"
            return _invalid(weight, c.BACKEND_NOT_FOUND, message)
        protocol = as_str(service_port.get("appProtocol"))
        if _is_tls_protocol(protocol):
            message = f"appProtocol {protocol!r} is not supported (no TLS to backends)"
            return _invalid(weight, c.UNSUPPORTED_PROTOCOL, message)
        name = f"service/{key[0]}/{key[1]}/{port}"
        if name not in self.resources:
            endpoints, _ = self._service_endpoints(service, service_port)
            self.resources[name] = Resources(
                self._service_cluster(name, http2=protocol in H2C),
                load_assignment(name, endpoints),
            )
        return Backend(weight, name, filters=filters)

    def _pool_backend(self, weight: int, key: Key, filters: tuple[Any, ...]) -> Backend:
        pool = self.pool(key)
        if pool is None:
            return _invalid(
                weight, c.BACKEND_NOT_FOUND, f"InferencePool {key[0]}/{key[1]} not found"
            )
        if pool.http2 is None:
            message = f"InferencePool {key[0]}/{key[1]} has an unsupported appProtocol"
            return Backend(weight, None, (c.UNSUPPORTED_PROTOCOL, message), pool=key)
        if pool.epp_state == "invalid" or (
            pool.epp_state == "missing" and self.options.pool_without_epp == "reject"
        ):
            # The pool's own status says why; its requests get 500 (never another pool).
            return Backend(weight, None, pool=key, filters=filters)
        ext_proc = None if pool.epp_cluster is None else self._ext_proc_override(pool)
        return Backend(weight, pool.cluster, pool=key, ext_proc=ext_proc, filters=filters)

    def _ext_proc_override(self, pool: Pool) -> Obj:
        """ExtProcPerRoute: turn the HCM's ext_proc on, toward this pool's EPP."""
        return {
            "@type": EXT_PROC_PER_ROUTE,
            "overrides": {
                "grpc_service": {
                    "envoy_grpc": {
                        "cluster_name": pool.epp_cluster,
                        "authority": pool.epp_authority,
                    },
                    # With EPP replicas: a stream that cannot open retries another one.
                    "retry_policy": envoy.EPP_STREAM_RETRY,
                },
                "failure_mode_allow": pool.failure_mode_allow,
            },
        }

    # --- InferencePools ----------------------------------------------------------

    def pool(self, key: Key) -> Pool | None:
        """The InferencePool ``key`` with its clusters registered, or None if absent."""
        if key not in self._pools:
            obj = self.pool_objects.get(key)
            self._pools[key] = None if obj is None else self._build_pool(key, obj)
        return self._pools[key]

    def _build_pool(self, key: Key, obj: Obj) -> Pool:
        spec = as_dict(obj.get("spec"))
        protocol = as_str(spec.get("appProtocol"))
        http2 = True if protocol in H2C else False if protocol in ("", "http") else None
        pool = Pool(key, meta(obj).generation, f"pool/{key[0]}/{key[1]}", http2, "ok")
        self._resolve_epp(pool, spec)
        if pool.cluster not in self.resources:
            endpoints = self._pool_endpoints(key[0], spec)
            self.resources[pool.cluster] = Resources(
                self._pool_cluster(pool.cluster, http2=bool(http2)),
                load_assignment(pool.cluster, endpoints),
            )
        return pool

    def _resolve_epp(self, pool: Pool, spec: dict[str, Any]) -> None:
        """endpointPickerRef → the EPP cluster (pods behind the Service port), or why not."""
        ref = spec.get("endpointPickerRef")
        if not isinstance(ref, dict):
            pool.epp_state = "missing"
            return
        pool.failure_mode_allow = ref.get("failureMode") == "FailOpen"
        problem, service, service_port = self._epp_service(pool.key[0], ref)
        if problem:
            pool.epp_state, pool.epp_message = "invalid", problem
            return
        assert service is not None and service_port is not None
        svc = meta(service)
        number = as_int(service_port.get("port")) or 0
        pool.epp_cluster = f"epp/{svc.namespace}/{svc.name}/{number}"
        pool.epp_authority = f"{svc.name}.{svc.namespace}.svc:{number}"
        if pool.epp_cluster not in self.resources:
            tls = self.options.epp_tls and service_port.get("appProtocol") not in H2C
            # A terminating EPP that still passes readiness stays, DEGRADED: it serves
            # through its preStop, and the Envoy's health checks see it withdraw; until a
            # new EPP passes them it is the one host left (an operator that is late sees a
            # new EPP's readiness and the old one's deletion at once).
            endpoints, degraded = self._service_endpoints(service, service_port, terminating=True)
            self.resources[pool.epp_cluster] = Resources(
                self._epp_cluster(pool.epp_cluster, f"{svc.name}.{svc.namespace}.svc", tls),
                load_assignment(pool.epp_cluster, endpoints, degraded),
            )

    def _epp_service(
        self, namespace: str, ref: dict[str, Any]
    ) -> tuple[str, Obj | None, dict[str, Any] | None]:
        group = as_str(ref.get("group"), CORE_GROUP)
        kind = as_str(ref.get("kind"), SERVICE_KIND)
        name = as_str(ref.get("name"))
        if (group, kind) != (CORE_GROUP, SERVICE_KIND):
            return f"endpointPickerRef kind {group}/{kind} is not supported", None, None
        service = self.services.get((namespace, name))
        if service is None:
            return f"endpointPickerRef Service {namespace}/{name} not found", None, None
        spec = as_dict(service.get("spec"))
        if spec.get("type") == "ExternalName":
            return "endpointPickerRef must not be an ExternalName Service", None, None
        number = as_int(as_dict(ref.get("port")).get("number"))
        if number is None:
            return "endpointPickerRef needs port.number", None, None
        service_port = _service_port(spec, number)
        if service_port is None:
            return f"Service {namespace}/{name} has no TCP port {number}", None, None
        return "", service, service_port

    def _pool_endpoints(self, namespace: str, spec: dict[str, Any]) -> list[tuple[str, int]]:
        """The pool's ready pods (matchLabels, same namespace) × each targetPort."""
        wanted = str_map(as_dict(spec.get("selector")).get("matchLabels"))
        ports = sorted(
            {
                n
                for n in (
                    as_int(as_dict(p).get("number")) for p in as_list(spec.get("targetPorts"))
                )
                if n is not None and valid_port(n)
            }
        )
        out = {(pod.ip, port) for pod in self._select(namespace, wanted) for port in ports}
        return sorted(out)

    # --- Services ----------------------------------------------------------------

    def _service_endpoints(
        self, service: Obj, service_port: dict[str, Any], *, terminating: bool = False
    ) -> tuple[list[tuple[str, int]], set[tuple[str, int]]]:
        """Ready pods behind a Service's selector, at the port's targetPort (named
        targetPorts resolved per pod), and which of them are terminating (only with
        ``terminating``: terminating pods whose readiness still passes are included)."""
        # A Service without a selector (hand-made Endpoints) is not followed: no pods.
        selector = str_map(as_dict(service.get("spec")).get("selector"))
        target = service_port.get("targetPort", service_port.get("port"))
        out: set[tuple[str, int]] = set()
        leaving: set[tuple[str, int]] = set()
        namespace = meta(service).namespace
        for pod in self._select(namespace, selector, terminating=terminating):
            port = _target_port(pod.obj, target)
            if port is not None:
                out.add((pod.ip, port))
                if pod.terminating:
                    leaving.add((pod.ip, port))
        return sorted(out), leaving

    # --- clusters ----------------------------------------------------------------

    def _eds_cluster(self, name: str) -> Obj:
        o = self.options
        return {
            "name": name,
            "type": "EDS",
            "eds_cluster_config": {
                "eds_config": {
                    "ads": {},
                    "resource_api_version": "V3",
                    "initial_fetch_timeout": "5s",
                },
            },
            "connect_timeout": envoy.duration(o.connect_timeout_s),
            "circuit_breakers": envoy.circuit_breakers(o.max_requests),
        }

    def _pool_cluster(self, name: str, *, http2: bool) -> Obj:
        cluster = self._eds_cluster(name)
        cluster["typed_extension_protocol_options"] = envoy.engine_protocol_options(http2=http2)
        cluster["load_balancing_policy"] = envoy.override_host_policy()
        return cluster

    def _service_cluster(self, name: str, *, http2: bool) -> Obj:
        cluster = self._eds_cluster(name)
        cluster["lb_policy"] = "LEAST_REQUEST"
        cluster["typed_extension_protocol_options"] = envoy.engine_protocol_options(http2=http2)
        return cluster

    def _epp_cluster(self, name: str, sni: str, tls: bool) -> Obj:
        cluster = self._eds_cluster(name)
        cluster["lb_policy"] = "LEAST_REQUEST"
        cluster["typed_extension_protocol_options"] = envoy.grpc_protocol_options()
        check = self.options.epp_health_check
        if check != "none":
            probe = (
                {"tcp_health_check": {}}
                if check == "tcp"
                else {"grpc_health_check": {"service_name": self.options.epp_health_service}}
            )
            cluster.update(envoy.epp_health_checks(self.options.epp_health_check_interval_s, probe))
            # EDS says which pods the Service selects: a picker it no longer selects gets
            # no new stream now, not once it fails a health check (it may stay healthy).
            cluster["ignore_health_on_host_removal"] = True
        if tls:
            cluster["transport_socket"] = envoy.epp_tls_transport_socket(sni)
        return cluster


def _weight(ref: dict[str, Any]) -> int:
    """backendRef weight: default 1, clamped to the CRD's 0..1,000,000."""
    weight = as_int(ref.get("weight"))
    if weight is None:
        return 1
    return min(max(weight, 0), _MAX_WEIGHT)


def _invalid(weight: int, reason: str, message: str) -> Backend:
    return Backend(weight, None, (reason, message))


def _service_port(spec: dict[str, Any], number: int) -> dict[str, Any] | None:
    """The Service's TCP port ``number`` (the port, not the targetPort)."""
    for port in map(as_dict, as_list(spec.get("ports"))):
        if as_int(port.get("port")) == number and as_str(port.get("protocol"), "TCP") == "TCP":
            return port
    return None


def _target_port(pod: Obj, target: Any) -> int | None:
    number = as_int(target)
    if number is not None:
        return number if valid_port(number) else None
    if isinstance(target, str) and target.isdigit():
        return int(target) if valid_port(int(target)) else None
    if isinstance(target, str) and target:
        return named_container_port(pod, target)
    return None


def _is_tls_protocol(protocol: str) -> bool:
    """appProtocols that mean TLS to the backend, which needs a BackendTLSPolicy here."""
    return protocol.lower() in ("https", "tls", "kubernetes.io/wss", "wss", "grpcs", "h2")


def load_assignment(
    name: str,
    endpoints: Iterable[tuple[str, int]],
    degraded: Collection[tuple[str, int]] = (),
) -> Obj:
    """The ClusterLoadAssignment of an EDS cluster (an empty one is valid: 503s).

    ``degraded`` endpoints get Envoy's ``health_status: DEGRADED``: used only while too
    few healthy hosts are left (a host still failing its first active health check is not
    healthy). Not DRAINING: Envoy counts that as unhealthy, and with panic routing off it
    would never be used."""
    lb_endpoints: list[Obj] = []
    for host, port in endpoints:
        entry: Obj = {"endpoint": {"address": envoy.socket_address(host, port)}}
        if (host, port) in degraded:
            entry["health_status"] = "DEGRADED"
        lb_endpoints.append(entry)
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": lb_endpoints}] if lb_endpoints else [],
    }
