"""A Snapshot's JSON dicts turned into the protobufs an ADS server sends, once per snapshot.

The translator speaks JSON-shaped dicts (what a bootstrap file looks like); Envoy speaks
``google.protobuf.Any``. Converting at :meth:`AdsServer.set_snapshot` time, not per
response, means a malformed dict is caught before any Envoy sees it (the old snapshot
keeps serving) and a hundred replicas cost one conversion, not a hundred.
"""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from google.protobuf import any_pb2, descriptor_pool, json_format
from google.protobuf.message import Message

from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    TYPE_ORDER,
    Obj,
    Snapshot,
)

log = logging.getLogger("infergate.gateway.xds")

_MESSAGES: dict[str, type[Message]] = {
    CLUSTER_TYPE: cluster_pb2.Cluster,
    ENDPOINT_TYPE: endpoint_pb2.ClusterLoadAssignment,
    LISTENER_TYPE: listener_pb2.Listener,
    ROUTE_TYPE: route_pb2.RouteConfiguration,
}
_WILDCARDS = frozenset({"0.0.0.0", "::"})


class SnapshotError(ValueError):
    """A snapshot resource that is not a valid Envoy v3 message (names the resource)."""


@dataclass(frozen=True)
class Resources:
    """One type's resources, parsed and packed: what a stream sends for that type.

    ``version`` uses :meth:`Snapshot.version`, so a view equal to a snapshot's resources
    has that snapshot's version and an operator can compare acked versions with it."""

    type_url: str
    version: str
    dicts: Mapping[str, Obj]
    messages: Mapping[str, Message]
    packed: Mapping[str, any_pb2.Any]

    def select(self, names: frozenset[str]) -> list[any_pb2.Any]:
        """The packed resources named (all of them for an empty, wildcard, name set)."""
        if not names:
            return list(self.packed.values())
        return [self.packed[name] for name in self.packed if name in names]


def resource_name(type_url: str, resource: Obj) -> str:
    """A resource's name: ``cluster_name`` for a ClusterLoadAssignment, else ``name``."""
    key = "cluster_name" if type_url == ENDPOINT_TYPE else "name"
    name = resource.get(key)
    if not isinstance(name, str) or not name:
        raise SnapshotError(f"{type_url.rsplit('.', 1)[-1]} without a {key}: {resource!r:.200}")
    return name


def compile_snapshot(snapshot: Snapshot) -> dict[str, Resources]:
    """Every type of ``snapshot`` parsed into protobufs; SnapshotError on the first bad one."""
    unknown = set(snapshot.resources) - set(TYPE_ORDER)
    if unknown:
        raise SnapshotError(f"resource types this server does not serve: {sorted(unknown)}")
    return {
        type_url: build(type_url, snapshot.resources.get(type_url, ())) for type_url in TYPE_ORDER
    }


def build(type_url: str, resources: tuple[Obj, ...] | list[Obj]) -> Resources:
    """Parse one type's dicts (in order; a duplicate name is an error)."""
    dicts: dict[str, Obj] = {}
    messages: dict[str, Message] = {}
    packed: dict[str, any_pb2.Any] = {}
    for resource in resources:
        name = resource_name(type_url, resource)
        if name in dicts:
            raise SnapshotError(f"two resources named {name!r} of {type_url}")
        message = _parse(type_url, name, resource)
        dicts[name], messages[name] = resource, message
        packed[name] = _pack(message)
    version = Snapshot({type_url: tuple(dicts.values())}).version(type_url)
    return Resources(type_url, version, dicts, messages, packed)


def merge(old: Resources | None, new: Resources) -> Resources:
    """``new`` plus the resources of ``old`` it dropped: the make-before-break view.

    Old names keep their place (with new content where ``new`` has them), so merging a
    snapshot that only drops resources into the view that has them changes nothing,
    version included, and sends nothing."""
    if old is None or set(old.dicts) <= set(new.dicts):
        return new
    order = [*old.dicts, *(name for name in new.dicts if name not in old.dicts)]

    def pick(name: str) -> Resources:
        return new if name in new.dicts or old is None else old

    dicts = {name: pick(name).dicts[name] for name in order}
    version = Snapshot({new.type_url: tuple(dicts.values())}).version(new.type_url)
    return Resources(
        new.type_url,
        version,
        dicts,
        {name: pick(name).messages[name] for name in order},
        {name: pick(name).packed[name] for name in order},
    )


def empty_assignment(cluster_name: str) -> any_pb2.Any:
    """An EDS answer with no endpoints, for a requested cluster the snapshot has none for:
    the cluster then finishes warming at once (and answers 503) instead of waiting out
    its initial fetch timeout."""
    return _pack(endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name))


def bind_listeners(resources: Resources, bind_address: str) -> list[any_pb2.Any]:
    """The listeners with their wildcard addresses replaced by ``bind_address``.

    Explicit addresses the translator chose are kept. See :mod:`infergate.gateway.xds`
    for why a proxy asks for this."""
    packed: list[any_pb2.Any] = []
    for message in resources.messages.values():
        listener = listener_pb2.Listener()
        listener.CopyFrom(message)
        _rebind(listener.address, bind_address)
        for extra in listener.additional_addresses:
            _rebind(extra.address, bind_address)
        packed.append(_pack(listener))
    return packed


def valid_bind_address(value: str) -> str | None:
    """``value`` when it is an IP literal (an unexpanded ``$(POD_IP)`` is not)."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


def _rebind(address: Any, bind_address: str) -> None:
    if address.HasField("socket_address") and address.socket_address.address in _WILDCARDS:
        address.socket_address.address = bind_address


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _parse(type_url: str, name: str, resource: Obj) -> Message:
    message = _MESSAGES[type_url]()
    for any_type in _any_types(resource):
        _import_type(any_type)
    try:
        json_format.ParseDict(resource, message)
    except (json_format.ParseError, TypeError, ValueError, KeyError) as error:
        kind = type_url.rsplit(".", 1)[-1]
        raise SnapshotError(f"{kind} {name!r}: {error}") from None
    return message


def _any_types(value: Any) -> Iterator[str]:
    """Every ``@type`` inside ``value``: the messages ParseDict must know to read Anys."""
    if isinstance(value, dict):
        any_type = value.get("@type")
        if isinstance(any_type, str):
            yield any_type
        for item in value.values():
            yield from _any_types(item)
    elif isinstance(value, list):
        for item in value:
            yield from _any_types(item)


@cache
def _import_type(type_url: str) -> None:
    """Load the generated module of an Any's message so json_format can parse it.

    Extension messages (HCM, router, ext_proc...) are only in the descriptor pool once
    their ``_pb2`` module is imported; the module's file name is not derivable from the
    message name, so every ``_pb2`` module of its proto package is imported (a handful).
    An unknown type stays unknown and ParseDict reports it."""
    full_name = type_url.rsplit("/", 1)[-1]
    try:
        descriptor_pool.Default().FindMessageTypeByName(full_name)
        return
    except KeyError:
        pass
    package = full_name.rsplit(".", 1)[0]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return
    for location in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(location).glob("*_pb2.py")):
            try:
                importlib.import_module(f"{package}.{path.stem}")
            except ImportError as error:  # pragma: no cover - a broken wheel
                log.debug("cannot import %s.%s: %s", package, path.stem, error)
