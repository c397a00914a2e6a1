"""kopf wiring of the Gateway API controller (GatewayClass ``infergate.io/gateway-controller``).

Thin on purpose. kopf indexes keep what the watches have seen of every kind the
translator reads; any change to any of them only marks the world dirty. ONE debounced
loop then rebuilds :class:`~infergate.gateway.types.ClusterObjects` from the indexes,
calls the pure translator, publishes each Gateway's snapshot on the ADS server, and hands
the rest to :class:`~infergate.operator.gateway.sync.GatewaySync` (proxy objects and
statuses, written only when they changed). One loop instead of a handler per object
because a Gateway's config depends on routes, pools, Services, grants and namespaces
at once: translating the whole world is the one way it is never half-updated, and a
burst of changes (``kubectl apply -f dir/``) costs one pass.

kopf starts the non-index handlers only once every index has its initial listing, so
the loop never publishes a snapshot from a partial view (which would drop routes on
every operator restart). Without the Gateway API CRDs nothing here is watched; kopf
notices the CRDs when they are installed and the controller starts then.

Loaded as a second kopf module by ``infergate operator`` unless ``--no-gateway``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from infergate.gateway.types import GATEWAY_CONTROLLER_NAME, GATEWAY_GROUP, ClusterObjects, node_id
from infergate.operator import constants as c
from infergate.operator.gateway import xds as gx
from infergate.operator.gateway.objects import (
    LABEL_GATEWAY,
    PROXY_COMPONENT,
    deployment_available,
    gateway_addresses,
    proxy_name,
)
from infergate.operator.gateway.sync import GatewayKube, GatewaySync, ProxyKey, key_of
from infergate.operator.kube import Kube, KubeError
from infergate.operator.settings import GatewaySettings, OperatorSettings

log = logging.getLogger("infergate.operator.gateway")
Obj = dict[str, Any]
MEMO_KEY = "infergate-gateway"
REFERENCE_GRANT_VERSION = "v1beta1"
_PROXY_LABELS = {c.LABEL_COMPONENT: PROXY_COMPONENT, c.LABEL_MANAGED_BY: "infergate-operator"}


@dataclass
class GatewayController:
    """The controller's state, in kopf's ``memo``: settings, the xDS server, the sync and
    the dirty flag the loop waits on."""

    settings: GatewaySettings
    sync: GatewaySync
    xds: gx.XdsPublisher
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by the first event: kopf has every index's initial listing by then.
    indexed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    passes: int = 0
    #: The installed Gateway API's bundle version (None: not installed when last read).
    api_version: str | None = None

    def mark_dirty(self) -> None:
        self.indexed.set()
        self.dirty.set()


def _controller(memo: kopf.Memo) -> GatewayController | None:
    controller: GatewayController | None = memo.get(MEMO_KEY)
    return controller


# -- kopf indexes: the world the translator reads ------------------------------------------


_HEAVY_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)


def _slim_meta(body: kopf.Body) -> Obj:
    """Metadata without what nobody here reads and can be large (managed fields, the
    client-side apply copy of the whole object)."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    annotations = meta.get("annotations") or {}
    if any(key in annotations for key in _HEAVY_ANNOTATIONS):
        meta["annotations"] = {k: v for k, v in annotations.items() if k not in _HEAVY_ANNOTATIONS}
    return meta


def _plain(body: kopf.Body) -> Obj:
    """The raw object with slim metadata (kopf's view is read-only and kept per event; a
    shallow copy is enough: the next event brings a new raw object, never a mutated one)."""
    return {**dict(body), "metadata": _slim_meta(body)}


def _trimmed(body: kopf.Body, spec_fields: tuple[str, ...], status_fields: tuple[str, ...]) -> Obj:
    """Only what the translator reads of a pod or Service (the cluster may have many)."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": _slim_meta(body),
        "spec": {k: spec[k] for k in spec_fields if k in spec},
        "status": {k: status[k] for k in status_fields if k in status},
    }


def _keyed(namespace: str | None, name: str, value: Obj) -> dict[tuple[str, str], Obj]:
    return {(namespace or "", name): value}


@kopf.index(GATEWAY_GROUP, "v1", "gatewayclasses")
def gw_classes(body: kopf.Body, name: str, **_: Any) -> Any:
    return _keyed(None, name, _plain(body))


@kopf.index(GATEWAY_GROUP, "v1", "gateways")
def gw_gateways(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    return _keyed(namespace, name, _plain(body))


@kopf.index(GATEWAY_GROUP, "v1", "httproutes")
def gw_http_routes(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    return _keyed(namespace, name, _plain(body))


@kopf.index(GATEWAY_GROUP, REFERENCE_GRANT_VERSION, "referencegrants")
def gw_reference_grants(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    return _keyed(namespace, name, _plain(body))


@kopf.index(c.POOL_GROUP, c.POOL_VERSION, c.POOL_PLURAL)
def gw_pools(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    return _keyed(namespace, name, _plain(body))


@kopf.index("", "v1", "services")
def gw_services(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    spec = ("type", "ports", "selector", "clusterIP", "clusterIPs", "externalName")
    return _keyed(namespace, name, _trimmed(body, spec, ("loadBalancer",)))


@kopf.index("", "v1", "pods")
def gw_pods(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    status = ("phase", "podIP", "podIPs", "conditions")
    return _keyed(namespace, name, _trimmed(body, ("nodeName",), status))


@kopf.index("", "v1", "namespaces")
def gw_namespaces(body: kopf.Body, name: str, **_: Any) -> Any:
    meta = body.get("metadata") or {}
    slim = {"name": name, "labels": dict(meta.get("labels") or {}), "uid": meta.get("uid")}
    return _keyed(None, name, {"apiVersion": "v1", "kind": "Namespace", "metadata": slim})


@kopf.index("apps", "v1", "deployments", labels=_PROXY_LABELS)
def gw_proxy_deployments(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    """Whole (one per Gateway): the sync compares the desired spec with the live one."""
    return _keyed(namespace, name, _plain(body))


INDEXES = (
    "gw_classes", "gw_gateways", "gw_http_routes", "gw_reference_grants", "gw_pools",
    "gw_services", "gw_pods", "gw_namespaces", "gw_proxy_deployments",
)  # fmt: skip


def _values(index: kopf.Index[Any, Any]) -> tuple[Obj, ...]:
    """Every object of an index (one per key: keys are (namespace, name))."""
    return tuple(value for key in list(index) for value in list(index.get(key, [])))


# -- building the translator's input ---------------------------------------------------------


def _proxy_objects(indexes: Mapping[str, kopf.Index[Any, Any]]) -> dict[ProxyKey, Obj]:
    """The live proxy Deployments and Services (by their infergate.io/gateway label)."""
    out: dict[ProxyKey, Obj] = {}
    for obj in _values(indexes["gw_proxy_deployments"]):
        out[("Deployment", *key_of(obj))] = obj
    for obj in _values(indexes["gw_services"]):
        if LABEL_GATEWAY in ((obj.get("metadata") or {}).get("labels") or {}):
            out[("Service", *key_of(obj))] = obj
    return out


def collect(
    indexes: Mapping[str, kopf.Index[Any, Any]],
    proxies: Mapping[ProxyKey, Obj],
    xds: gx.XdsPublisher,
) -> ClusterObjects:
    """The translator's input from the indexes, with what the operator knows of each
    Gateway's proxy: its addresses, and Programmed = Deployment available AND every
    connected Envoy acked the current snapshot."""
    gateways = _values(indexes["gw_gateways"])
    addresses: dict[tuple[str, str], tuple[str, ...]] = {}
    programmed: dict[tuple[str, str], bool] = {}
    for gateway in gateways:
        namespace, name = key = key_of(gateway)
        proxy = proxy_name(name)
        addresses[key] = gateway_addresses(proxies.get(("Service", namespace, proxy)))
        available = deployment_available(proxies.get(("Deployment", namespace, proxy)))
        programmed[key] = available and xds.acked(node_id(namespace, name))
    return ClusterObjects(
        gateway_classes=_values(indexes["gw_classes"]),
        gateways=gateways,
        http_routes=_values(indexes["gw_http_routes"]),
        reference_grants=_values(indexes["gw_reference_grants"]),
        inference_pools=_values(indexes["gw_pools"]),
        services=_values(indexes["gw_services"]),
        pods=_values(indexes["gw_pods"]),
        namespaces=_values(indexes["gw_namespaces"]),
        gateway_addresses=addresses,
        gateway_programmed=programmed,
    )


# -- the loop ------------------------------------------------------------------------------


async def reconcile_once(
    controller: GatewayController, indexes: Mapping[str, kopf.Index[Any, Any]]
) -> None:
    """One pass: translate the whole world, publish, apply, write statuses."""
    from infergate.gateway.translate import translate

    started = time.monotonic()
    proxies = _proxy_objects(indexes)
    objects = collect(indexes, proxies, controller.xds)
    translation = await asyncio.to_thread(
        translate, objects, gx.translate_options(controller.api_version or None)
    )
    published = controller.xds.publish_all(translation.snapshots)
    result = await asyncio.to_thread(controller.sync.sync, objects, translation, proxies)
    controller.passes += 1
    if result.retry:
        controller.dirty.set()
    for error in result.errors:
        log.warning("gateway controller: not written: %s", error)
    if result or published:
        log.info(
            "gateway pass %d: %d gateways, %d routes; published=%s applied=%s deleted=%s "
            "statuses=%s conflicts=%s (%.0f ms)",
            controller.passes, len(translation.snapshots), len(objects.http_routes), published,
            result.applied, result.deleted, result.statuses, result.conflicts,
            (time.monotonic() - started) * 1000,
            extra={
                "gateways": len(translation.snapshots), "published": published,
                "applied": result.applied, "deleted": result.deleted,
                "statuses": result.statuses, "conflicts": result.conflicts,
            },
        )  # fmt: skip


async def _resync(controller: GatewayController) -> None:
    """The periodic resync: re-read what the watches do not show (ConfigMap drift, the
    Gateway API version, which changes when its CRDs are upgraded)."""
    controller.sync.forget()
    try:
        controller.api_version = await asyncio.to_thread(gateway_api_version, controller.sync.kube)
    except KubeError as error:
        log.warning("cannot read the Gateway API version: %s", error)


async def _reconcile_forever(
    controller: GatewayController, indexes: Mapping[str, kopf.Index[Any, Any]], resync: float
) -> None:
    """Wait for a change (or the periodic resync), let the burst settle, run one pass."""
    await controller.indexed.wait()
    while True:
        try:
            await asyncio.wait_for(controller.dirty.wait(), timeout=resync)
        except TimeoutError:
            await _resync(controller)
        await asyncio.sleep(controller.settings.debounce_seconds)
        controller.dirty.clear()
        try:
            await reconcile_once(controller, indexes)
        except Exception as error:  # retried after a pause; a bad pass must not end the loop
            log.warning("gateway pass failed: %s", error, exc_info=True)
            await asyncio.sleep(1.0)
            controller.dirty.set()


# -- kopf handlers -------------------------------------------------------------------------


GATEWAYS_CRD = f"gateways.{GATEWAY_GROUP}"
BUNDLE_VERSION = f"{GATEWAY_GROUP}/bundle-version"


def gateway_api_version(kube: Kube) -> str | None:
    """The installed Gateway API's bundle version ("" if its CRDs do not say), or None
    when the Gateway API is not installed. A list, not a get: kopf's discovery role may
    list CRDs and nothing more."""
    found = kube.call(
        "GET",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        query=[("fieldSelector", f"metadata.name={GATEWAYS_CRD}")],
    )
    for crd in found.get("items") or []:
        return str(((crd.get("metadata") or {}).get("annotations") or {}).get(BUNDLE_VERSION, ""))
    return None


@kopf.on.startup()
async def start_gateway_controller(memo: kopf.Memo, **kwargs: Any) -> None:
    """Start the xDS server and the loop; say plainly when there is no Gateway API."""
    settings = GatewaySettings.from_env()
    operator_settings = OperatorSettings.from_env()
    kube = GatewayKube()
    version = await asyncio.to_thread(gateway_api_version, kube)
    if version is None:
        log.warning(
            "the Gateway API (%s/v1) is not installed: the Gateway controller %s waits for "
            "its CRDs (they are picked up when installed); InferencePools are served as before",
            GATEWAY_GROUP, GATEWAY_CONTROLLER_NAME,
        )  # fmt: skip
    xds = gx.XdsPublisher(settings)
    try:
        await xds.start()
    except RuntimeError as error:  # the port is taken: two operators would split the Envoys
        raise kopf.PermanentError(f"the xDS server cannot start: {error}") from error
    sync = GatewaySync(
        kube, settings, operator_settings, gx.proxy_config_factory(settings, xds.port)
    )
    controller = GatewayController(settings=settings, sync=sync, xds=xds, api_version=version)
    xds.on_ack(controller.mark_dirty)
    memo[MEMO_KEY] = controller
    indexes = {name: kwargs[name] for name in INDEXES}
    controller.task = asyncio.create_task(
        _reconcile_forever(controller, indexes, operator_settings.resync_seconds)
    )
    log.info(
        "Gateway controller %s: xDS on %s:%d, Envoys dial %s:%d",
        GATEWAY_CONTROLLER_NAME, settings.xds_listen_address, settings.xds_port,
        settings.xds_address, settings.xds_port,
    )  # fmt: skip


@kopf.on.cleanup()
async def stop_gateway_controller(memo: kopf.Memo, **_: Any) -> None:
    controller = _controller(memo)
    if controller is None:
        return
    if controller.task is not None:
        controller.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await controller.task
    await controller.xds.stop()


@kopf.on.event(GATEWAY_GROUP, "v1", "gatewayclasses")
@kopf.on.event(GATEWAY_GROUP, "v1", "gateways")
@kopf.on.event(GATEWAY_GROUP, "v1", "httproutes")
@kopf.on.event(GATEWAY_GROUP, REFERENCE_GRANT_VERSION, "referencegrants")
@kopf.on.event(c.POOL_GROUP, c.POOL_VERSION, c.POOL_PLURAL)
@kopf.on.event("", "v1", "services")
@kopf.on.event("", "v1", "namespaces")
@kopf.on.event("apps", "v1", "deployments", labels=_PROXY_LABELS)
async def gateway_world_changed(memo: kopf.Memo, **_: Any) -> None:
    """Anything the translator reads changed (its index is already updated)."""
    controller = _controller(memo)
    if controller is not None:
        controller.mark_dirty()


@kopf.on.event("", "v1", "pods")
async def gateway_pod_changed(
    namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A pod changed: only one an InferencePool selects is an endpoint of a Gateway."""
    controller = _controller(memo)
    if controller is None:
        return
    if not controller.indexed.is_set() or any(
        _selects(pool, namespace or "", labels) for pool in _values(kwargs["gw_pools"])
    ):
        controller.mark_dirty()


def _selects(pool: Obj, namespace: str, labels: Mapping[str, str]) -> bool:
    if key_of(pool)[0] != namespace:
        return False
    wanted = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())
