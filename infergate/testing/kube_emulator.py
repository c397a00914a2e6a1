"""A Kubernetes API server for tests: KMock's emulator taught the API-server behaviour
the operator relies on.

KMock's ``KubernetesEmulator`` stores objects and serves list/watch/get over real HTTP,
but merges every write as a plain dict. :class:`KubeEmulator` adds, as the real API
server does:

- object metadata: ``uid``, ``creationTimestamp``, ``resourceVersion`` (bumped only on
  real changes), ``generation`` (bumped when anything but metadata/status changes);
- server-side apply (``application/apply-patch+yaml``): create-or-update, and fields a
  manager applied before but no longer applies are removed (lists are atomic here);
  ``managedFields`` records the managers;
- JSON merge patch, JSON patch, ``metadata.resourceVersion`` preconditions (409);
- the ``status`` subresource: status writes change only status, main-resource writes
  never change status, create drops status;
- CRD defaulting and validation (OpenAPI schema + CEL rules) for custom resources (422);
- ``labelSelector`` on list;
- deletion with finalizers (``deletionTimestamp``) and owner-reference garbage
  collection (cascading, immediate);
- ``generateName``.

Use it in-process (async tests)::

    async with serve_emulator(crd_paths=[Path("crds")]) as emu:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
        ...  # start the operator with KUBECONFIG=kubeconfig
        await emu.create_object({...})
        emu.get_object("Deployment", "default", "x")

or as a process: ``python -m infergate.testing.kube_emulator --port 8001 --crds crds``.
The test-side helpers (:meth:`KubeEmulator.create_object`, :meth:`~KubeEmulator.patch_object`,
:meth:`~KubeEmulator.delete_object`, :meth:`~KubeEmulator.set_deployment_available`,
:meth:`~KubeEmulator.add_pod`) go through the same code as HTTP writes, so watchers
see them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime
import itertools
import json
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import kmock
import yaml
from kmock._internal import apps, dicts, k8s, parsing, rendering

from infergate.operator.crd_validation import CRDRegistry, CRDVersion, load_crds

Obj = dict[str, Any]

#: The built-in kinds the emulator serves: kind -> (group, version, plural, namespaced).
BUILTIN_KINDS: dict[str, tuple[str, str, str, bool]] = {
    "Namespace": ("", "v1", "namespaces", False),
    "Pod": ("", "v1", "pods", True),
    "Service": ("", "v1", "services", True),
    "ConfigMap": ("", "v1", "configmaps", True),
    "Secret": ("", "v1", "secrets", True),
    "ServiceAccount": ("", "v1", "serviceaccounts", True),
    "Event": ("", "v1", "events", True),
    "Deployment": ("apps", "v1", "deployments", True),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings", True),
    "ClusterRole": ("rbac.authorization.k8s.io", "v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", False),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets", True),
    "Lease": ("coordination.k8s.io", "v1", "leases", True),
    "CustomResourceDefinition": ("apiextensions.k8s.io", "v1", "customresourcedefinitions", False),
}
#: Built-in kinds with a status subresource.
BUILTIN_STATUS = {"Pod", "Service", "Deployment", "PodDisruptionBudget", "Namespace"}
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """KMock reads ``/api/v1/namespaces[/NAME[/status]]`` as a namespace prefix and fails;
    here it is the cluster-scoped ``namespaces`` resource, as on a real server."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
        len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))
    ):
        return parsing.ParsedPath(
            group="", version="v1", plural="namespaces",
            name=parts[3] if len(parts) > 3 else None,
            subresource=parts[4] if len(parts) > 4 else None,
        )  # fmt: skip
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path  # rendering.Request._parse looks it up on the module


def _error(status: int, reason: str, message: str) -> k8s.KubernetesError:
    return k8s.KubernetesError(status=status, reason=reason, message=message, details={})


def _now() -> str:
    return (
        datetime.datetime.now(tz=datetime.UTC)
        .replace(microsecond=0)
        .isoformat()
        .replace("+00:00", "Z")
    )


def _body(obj: Obj) -> Obj:
    """Everything but metadata and status: what ``generation`` tracks."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _drop_unapplied(live: Any, before: Any, after: Any) -> Any:
    """Remove from ``live`` the fields ``before`` set that ``after`` no longer sets."""
    if not (isinstance(live, dict) and isinstance(before, dict)):
        return live
    after = after if isinstance(after, dict) else {}
    result = dict(live)
    for key, old in before.items():
        if key not in after:
            result.pop(key, None)
        elif key in result:
            result[key] = _drop_unapplied(result[key], old, after[key])
    return result


def _deep_merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = _deep_merge(base.get(key), value)
        return merged
    return copy.deepcopy(patch)


def _matches_selector(labels: dict[str, str], selector: str) -> bool:
    """Equality, inequality, existence and set-based requirements, comma-separated."""
    for raw in _split_selector(selector):
        term = raw.strip()
        if not term:
            continue
        if " in " in term or " notin " in term:
            key, op, values = term.replace("(", " ").replace(")", " ").split(None, 2)
            allowed = {v.strip() for v in values.split(",")}
            present = labels.get(key) in allowed
            if (op == "in") != present:
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _matches_fields(obj: Obj, selector: str) -> bool:
    """Field selectors: ``path=value``, ``path==value``, ``path!=value`` on dotted paths."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        path, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        current: Any = obj
        for part in path.strip().split("."):
            current = current.get(part) if isinstance(current, dict) else None
        if (str(current if current is not None else "") == value.strip()) == negate:
            return False
    return True


def _split_selector(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [*terms, current]


def _stamp_manager(obj: Obj, manager: str | None, live: Obj | None) -> None:
    """Record ``manager`` in ``metadata.managedFields`` (who applied; no field sets)."""
    meta = obj.setdefault("metadata", {})
    old = [e for e in ((live or {}).get("metadata", {}).get("managedFields") or [])]
    others = [e for e in old if e.get("manager") != manager]
    mine = [e for e in old if e.get("manager") == manager]
    if mine and live is not None and _body(live) == _body(obj):
        entry = mine[0]  # unchanged content: keep the entry (and its time) as it was
    else:
        entry = {
            "manager": manager,
            "operation": "Apply",
            "apiVersion": obj.get("apiVersion"),
            "time": _now(),
            "fieldsType": "FieldsV1",
        }
    meta["managedFields"] = [*others, entry]


@attrs.define(kw_only=True)
class KubeEmulator(k8s.KubernetesEmulator):
    """KMock's KubernetesEmulator with API-server semantics (see the module docstring)."""

    crd_paths: Sequence[Path] = ()
    _crds: CRDRegistry = attrs.field(init=False, default=None)
    _kinds: dict[str, kmock.resource] = attrs.field(init=False, factory=dict)
    _status_kinds: set[kmock.resource] = attrs.field(init=False, factory=set)
    _applied: dict[tuple[Any, ...], dict[str, Obj]] = attrs.field(init=False, factory=dict)
    _rv: Any = attrs.field(init=False, factory=lambda: itertools.count(1000))
    _direct: dict[Any, Any] = attrs.field(init=False, factory=dict)
    _baseline_payloads: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind, (group, version, plural, namespaced) in BUILTIN_KINDS.items():
            self._register(kind, group, version, plural, namespaced, kind in BUILTIN_STATUS)
        versions = load_crds(self.crd_paths)
        self._crds = CRDRegistry(versions)
        for crd in versions:
            self._register_crd(crd)
        self._direct = {
            kmock.action.LIST: self._serve_list,
            kmock.action.WATCH: self._serve_watch,
            kmock.action.FETCH: self._serve_fetch,
            kmock.action.CREATE: self._serve_create,
            kmock.action.UPDATE: self._serve_update,
            kmock.action.DELETE: self._serve_delete,
        }
        self._baseline_payloads = len(self._payloads)

    # ----------------------------------------------------------------- resources

    def _register(
        self, kind: str, group: str, version: str, plural: str, namespaced: bool, status: bool
    ) -> None:
        resource = kmock.resource(group, version, plural)
        self.resources[resource] = kmock.ResourceInfo(
            kind=kind,
            namespaced=namespaced,
            verbs=_VERBS,
            subresources={"status"} if status else set(),
        )
        self._kinds[kind] = resource
        if status:
            self._status_kinds.add(resource)

    def _register_crd(self, crd: CRDVersion) -> None:
        self._register(
            crd.kind,
            crd.group,
            crd.version,
            crd.plural,
            crd.namespaced,
            "status" in crd.subresources,
        )

    def resource_of(self, kind: str) -> kmock.resource:
        """The resource serving ``kind`` (e.g. "Deployment", "InferencePool")."""
        try:
            return self._kinds[kind]
        except KeyError:
            raise KeyError(f"the emulator serves no kind {kind!r}") from None

    def _kind_of(self, resource: Any) -> str | None:
        for kind, res in self._kinds.items():
            if res == resource:
                return kind
        return None

    # ----------------------------------------------------------------- reading

    def get_object(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        """The live object, or None (a deep copy: mutate freely)."""
        key = (self.resource_of(kind), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def list_objects(self, kind: str, namespace: str | None = None) -> list[Obj]:
        resource = self.resource_of(kind)
        return [
            copy.deepcopy(obj.raw)
            for (res, ns, _), obj in list(self._objects.items())
            if res == resource and not obj.deleted and (namespace is None or ns == namespace)
        ]

    def write_requests(self, since: int = 0) -> list[rendering.Request]:
        """API writes (create/update/patch/delete) received over HTTP, oldest first;
        ``since`` skips the first writes (``len(emu.write_requests())`` marks "now")."""
        writes = [
            r
            for r in self._requests
            if r.resource is not None and str(r.method.value).upper() in WRITE_METHODS
        ]
        return writes[since:]

    @property
    def request_count(self) -> int:
        return len(self._requests)

    # ----------------------------------------------------------------- test-side writes

    async def create_object(self, obj: Obj) -> Obj:
        kind = obj["kind"]
        namespace = (obj.get("metadata") or {}).get("namespace")
        if self.resources[self.resource_of(kind)].namespaced:
            namespace = namespace or "default"
        async with self._lock:
            return await self._create(self.resource_of(kind), namespace, copy.deepcopy(obj))

    async def patch_object(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Any,
        *,
        subresource: str | None = None,
    ) -> Obj:
        """A JSON merge patch (dict) or JSON patch (list), as a client would send it."""
        async with self._lock:
            return await self._update(
                self.resource_of(kind), namespace, name, patch, "merge", subresource, None
            )

    async def delete_object(self, kind: str, namespace: str | None, name: str) -> None:
        async with self._lock:
            await self._delete(self.resource_of(kind), namespace, name, None)

    async def set_deployment_available(self, namespace: str, name: str) -> Obj:
        """Play the Deployment controller: all replicas ready and available."""
        deployment = self.get_object("Deployment", namespace, name)
        if deployment is None:
            raise KeyError(f"no Deployment {namespace}/{name}")
        replicas = int(deployment.get("spec", {}).get("replicas", 1))
        status = {
            "observedGeneration": deployment["metadata"].get("generation", 1),
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}
            ],
        }
        return await self.patch_object(
            "Deployment", namespace, name, {"status": status}, subresource="status"
        )

    async def add_pod(
        self,
        namespace: str,
        name: str,
        labels: dict[str, str],
        *,
        ready: bool = True,
        ip: str = "10.0.0.1",
    ) -> Obj:
        """Play the kubelet: a Running pod with the given readiness."""
        await self.create_object(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": labels},
                "spec": {"containers": [{"name": "engine", "image": "infergate/engine"}]},
            }
        )
        status = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        return await self.patch_object(
            "Pod", namespace, name, {"status": status}, subresource="status"
        )

    # ----------------------------------------------------------------- HTTP entry

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None and request.action in (
            kmock.action.CREATE,
            kmock.action.UPDATE,
            kmock.action.DELETE,
        ):
            async with self._lock:
                await self._write(request)
        # KMock matches every request against its whole request history (cost grows with
        # each request); with no user reactions registered, serve resources directly.
        serve = self._direct.get(request.action) if request.action is not None else None
        if (
            serve is not None
            and request.resource is not None
            and request.resource.plural
            and len(self._payloads) == self._baseline_payloads
        ):
            return await rendering.Response(payload=serve)(request)
        # Skip KubernetesEmulator's own dict-merging writes; serve via the fallbacks.
        return await super(k8s.KubernetesEmulator, self)._handle(request)

    async def _write(self, request: rendering.Request) -> None:
        resource = request.resource
        if resource not in self.resources:
            raise k8s.KubernetesResourceNotFoundError()
        if request.action == kmock.action.CREATE:
            data = request.data if isinstance(request.data, dict) else {}
            created = await self._create(resource, request.namespace, data)
            # Let the fallback find the object under its (possibly generated) name.
            data.setdefault("metadata", {})["name"] = created["metadata"]["name"]
        elif request.action == kmock.action.UPDATE:
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            mode = {
                "application/apply-patch+yaml": "apply",
                "application/json-patch+json": "json",
                "application/merge-patch+json": "merge",
                "application/strategic-merge-patch+json": "merge",
            }.get(content_type)
            if mode is None:
                raise _error(
                    415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"
                )
            data = request.data
            if mode == "apply" and not isinstance(data, dict):
                data = yaml.safe_load(request.text)
            manager = request.params.get("fieldManager") or None
            if mode == "apply" and not manager:
                raise _error(422, "Invalid", "fieldManager is required for apply requests")
            await self._update(
                resource, request.namespace, request.name, data, mode, request.subresource, manager
            )
        elif request.action == kmock.action.DELETE:
            options = request.data if isinstance(request.data, dict) else {}
            await self._delete(resource, request.namespace, request.name, options)

    # ----------------------------------------------------------------- semantics

    def _key(self, resource: Any, namespace: str | None, name: str) -> tuple[Any, str | None, str]:
        info = self.resources[resource]
        return (resource, namespace if info.namespaced else None, name)

    def _live(self, key: tuple[Any, ...]) -> Obj | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def _validate(self, obj: Obj) -> Obj:
        crd = self._crds.find(obj.get("apiVersion", ""), obj.get("kind", ""))
        if crd is None:
            return obj
        defaulted = crd.default(obj)
        metadata = defaulted.pop("metadata", None)
        problems = crd.errors(defaulted)
        defaulted["metadata"] = metadata
        if problems:
            name = (metadata or {}).get("name")
            raise _error(
                422, "Invalid", f"{obj.get('kind')} {name!r} is invalid: " + "; ".join(problems)
            )
        return defaulted

    async def _emit(self, resource: Any, type_: str, obj: Obj) -> None:
        await self._buses[resource].put({"type": type_, "object": copy.deepcopy(obj)})

    async def _create(self, resource: Any, namespace: str | None, data: Obj) -> Obj:
        obj = copy.deepcopy(data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if self.resources[resource].namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        key = self._key(resource, meta.get("namespace"), meta["name"])
        if self._live(key) is not None:
            raise _error(409, "AlreadyExists", f"{resource.plural} {meta['name']!r} already exists")
        kind = self._kind_of(resource)
        if kind:
            obj.setdefault("kind", kind)
        if resource in self._status_kinds:
            obj.pop("status", None)
        obj = self._validate(obj)
        meta = obj["metadata"]
        meta.update(
            uid=str(uuid.uuid4()),
            creationTimestamp=_now(),
            resourceVersion=str(next(self._rv)),
            generation=1,
        )
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        await self._emit(resource, "ADDED", obj)
        return obj

    async def _update(
        self,
        resource: Any,
        namespace: str | None,
        name: str | None,
        patch: Any,
        mode: str,
        subresource: str | None,
        manager: str | None,
    ) -> Obj:
        if name is None:
            raise _error(405, "MethodNotAllowed", "patching a collection is not supported")
        key = self._key(resource, namespace, name)
        live = self._live(key)
        if live is None and mode == "apply" and subresource is None:
            self._applied[key] = {manager or "": copy.deepcopy(patch)}
            data = copy.deepcopy(patch)
            _stamp_manager(data, manager, None)
            return await self._create(resource, namespace, data)
        if live is None:
            raise k8s.KubernetesObjectNotFoundError()

        if isinstance(patch, dict):
            wanted_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted_rv and wanted_rv != live["metadata"].get("resourceVersion"):
                raise _error(
                    409,
                    "Conflict",
                    f"Operation cannot be fulfilled on {resource.plural} {name!r}: "
                    "the object has been modified; please apply your changes to the latest version",
                )
            patch = copy.deepcopy(patch)
            patch.get("metadata", {}).pop("resourceVersion", None)

        if mode == "apply":
            before = self._applied.get(key, {}).get(manager or "", {})
            new = _deep_merge(_drop_unapplied(live, before, patch), patch)
            self._applied.setdefault(key, {})[manager or ""] = copy.deepcopy(patch)
        else:
            new = dicts.patch_dict(live, patch)
            new = json.loads(json.dumps(new))  # plain dicts and lists again

        has_status = resource in self._status_kinds
        if subresource == "status":
            new = {**live, "status": new.get("status")}
            if new["status"] is None:
                new.pop("status")
        elif has_status:
            if "status" in live:
                new["status"] = live["status"]
            else:
                new.pop("status", None)
        # Identity fields are the server's.
        for field in (
            "uid",
            "creationTimestamp",
            "resourceVersion",
            "generation",
            "name",
            "namespace",
        ):
            if field in live["metadata"]:
                new.setdefault("metadata", {})[field] = live["metadata"][field]
        new = self._validate(new)

        if mode == "apply":
            _stamp_manager(new, manager, live)
        if new == live:
            return live  # a no-op write changes nothing, as on a real server
        if _body(new) != _body(live):
            new["metadata"]["generation"] = int(live["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        self._objects[key].history.append(new)
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(key)
            return new
        await self._emit(resource, "MODIFIED", new)
        return new

    async def _delete(
        self, resource: Any, namespace: str | None, name: str | None, options: Obj | None
    ) -> None:
        if name is None:
            raise _error(405, "MethodNotAllowed", "deleting a collection is not supported")
        key = self._key(resource, namespace, name)
        live = self._live(key)
        if live is None:
            raise k8s.KubernetesObjectNotFoundError()
        wanted_uid = ((options or {}).get("preconditions") or {}).get("uid")
        if wanted_uid and wanted_uid != live["metadata"].get("uid"):
            raise _error(409, "Conflict", f"precondition failed: UID in precondition: {wanted_uid}")
        if live["metadata"].get("finalizers"):
            if not live["metadata"].get("deletionTimestamp"):
                live["metadata"]["deletionTimestamp"] = _now()
                live["metadata"]["resourceVersion"] = str(next(self._rv))
                self._objects[key].history.append(live)
                await self._emit(resource, "MODIFIED", live)
            return
        await self._remove(key)

    async def _remove(self, key: tuple[Any, ...]) -> None:
        """Delete now, then garbage-collect dependents (ownerReferences), recursively."""
        resource = key[0]
        obj = self._live(key)
        if obj is None:
            return
        self._objects[key].delete()
        self._applied.pop(key, None)
        await self._emit(resource, "DELETED", obj)
        uid = obj["metadata"].get("uid")
        dependents = [
            dep_key
            for dep_key, dep in list(self._objects.items())
            if not dep.deleted
            and any(
                ref.get("uid") == uid
                for ref in (dep.raw.get("metadata", {}).get("ownerReferences") or [])
            )
        ]
        for dep_key in dependents:
            dep = self._live(dep_key)
            if dep is not None and dep["metadata"].get("finalizers"):
                await self._delete(dep_key[0], dep_key[1], dep_key[2], None)
            else:
                await self._remove(dep_key)

    # ----------------------------------------------------------------- list/watch filtering

    @staticmethod
    def _selected(obj: Obj, labels: str | None, fields: str | None) -> bool:
        meta = obj.get("metadata") or {}
        if labels and not _matches_selector(meta.get("labels") or {}, labels):
            return False
        return not fields or _matches_fields(obj, fields)

    async def _serve_list(self, request: rendering.Request) -> Any:
        result = await super()._serve_list(request)
        labels = request.params.get("labelSelector")
        fields = request.params.get("fieldSelector")
        if isinstance(result, dict):
            result["items"] = [
                item for item in result.get("items", []) if self._selected(item, labels, fields)
            ]
            result["metadata"] = {"resourceVersion": str(next(self._rv))}
        return result

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        labels = request.params.get("labelSelector")
        fields = request.params.get("fieldSelector")
        async for item in super()._serve_watch(request):
            event_obj = item.get("object") if isinstance(item, dict) else None
            if event_obj is not None and not self._selected(event_obj, labels, fields):
                continue
            yield item


async def wait_for(probe: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``probe`` (sync, cheap) until it returns something truthy; AssertionError after
    ``timeout``. Yields to the event loop between polls, so an in-process emulator serves."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = probe()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last={last!r}")


def pool_conditions(
    emu: KubeEmulator,
    name: str,
    namespace: str = "default",
    controller: str = "infergate.io/operator",
) -> dict[str, Obj]:
    """The conditions, by type, of one controller's ``status.parents[]`` entry ({} if none)."""
    pool = emu.get_object("InferencePool", namespace, name) or {}
    for parent in (pool.get("status") or {}).get("parents") or []:
        if parent.get("controllerName") == controller:
            return {c["type"]: c for c in parent.get("conditions") or []}
    return {}


@contextlib.asynccontextmanager
async def serve_emulator(
    crd_paths: Iterable[Path] = (), *, host: str = "127.0.0.1", port: int | None = None
) -> AsyncIterator[KubeEmulator]:
    """Run a :class:`KubeEmulator` on a real TCP port; ``emu.url`` is its base URL."""
    async with (
        KubeEmulator(crd_paths=tuple(crd_paths)) as emulator,
        apps.Server(emulator, host=host, port=port),
    ):
        yield emulator


def write_kubeconfig(path: Path, url: str, namespace: str = "default") -> Path:
    """A kubeconfig that points kopf and the kubernetes client at ``url`` (no auth)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": str(url).rstrip("/")}}],
        "users": [{"name": "emulator", "user": {}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
            }
        ],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def _main(args: argparse.Namespace) -> None:
    async with serve_emulator([Path(p) for p in args.crds], host=args.host, port=args.port) as emu:
        if args.kubeconfig:
            write_kubeconfig(Path(args.kubeconfig), str(emu.url))
        print(f"kube emulator listening on {emu.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--crds", action="append", default=[], help="CRD file or folder")
    parser.add_argument("--kubeconfig", help="write a kubeconfig for the emulator here")
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
