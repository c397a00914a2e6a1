"""The ADS server every Gateway's Envoy pulls its listeners, routes and clusters from.

State of the world, v3, over one aggregated gRPC stream per Envoy. The operator calls
:meth:`AdsServer.set_snapshot` with a Gateway's :class:`~infergate.gateway.types.Snapshot`
under the Gateway's node id; every Envoy replica of that Gateway converges on it, and
:meth:`AdsServer.wait_acked` / :meth:`AdsServer.status` say when they have (the Gateway's
Programmed condition).

**Make before break.** A route must never name a cluster Envoy lacks or has not warmed,
or requests get 503 (``NC``/no healthy upstream) while the update lands. Each stream
therefore walks every new snapshot through five stages, each gated on Envoy's ACK of the
previous one:

1. *make*: clusters = new ∪ old (a cluster the snapshot drops stays for now), endpoints
   likewise. Envoy holds the CDS ACK back until every cluster it warms (waiting for its
   endpoints) is warm, so the ACK means "every new cluster is usable".
2. *listeners*: the new listeners (Envoy drains the old ones gracefully itself).
3. *routes*: the new route configurations (plus ones still named by draining listeners).
4. *break*: exactly the snapshot's clusters and routes; the clusters nothing routes to
   any more go away. Their endpoints go last (5, *clean*), once Envoy dropped the
   clusters: answering a removed cluster's name with no endpoints while it still existed
   would empty it under a request still draining from it.

A stage whose resources did not change passes at once, so a route-only change costs one
round trip. A NACK stops the walk where it is: Envoy keeps serving what it had, the NACK
is visible in :meth:`AdsServer.status`, and the next snapshot starts a new walk.

(The approach of the Go control plane's ADS mode is the same idea at a coarser grain: it
answers types in CDS, EDS, LDS, RDS order and only once every requested name exists; it
leaves removing stale clusters to the snapshot's author. Here the server does it.)

**Protocol details that matter with a real Envoy.** One response per type in flight: the
next goes after Envoy answered the last (its nonce), so ACKs are unambiguous. A request
carrying an older nonce is stale and ignored. A request that is neither an ACK nor stale
(a first request, or Envoy asking again because a cluster it re-created waits for
endpoints it already had) is always answered, even with an unchanged version; otherwise
an updated EDS cluster would warm until its initial fetch timeout.

**Bind address.** The translator emits listeners on ``0.0.0.0``. When a proxy's node
metadata carries ``infergate.io/bind-address`` (the bootstrap's command line puts
``$(POD_IP)`` there), wildcard listener addresses are rewritten to it for that proxy.
Why: Envoy listeners set SO_REUSEPORT by default, so two Envoys that both bind
``0.0.0.0:80`` on one network namespace *both succeed* and the kernel splits connections
between them: one Gateway silently answering for another. That happens wherever pods
share a host network (the tests here give every pod a loopback IP on one host) and is
harmless in a normal pod, where the pod IP is what it would have served anyway.

**Bounds.** At most ``max_streams`` concurrent streams (more get RESOURCE_EXHAUSTED), a
first request within ``first_request_timeout_s``, request size and name count capped;
corrupt frames or a request without a node id end that stream only. A snapshot that is
not valid Envoy config (ParseDict fails) is rejected by :meth:`AdsServer.set_snapshot`
with a logged error, and the node keeps its previous snapshot.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError

from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    ROUTE_TYPE,
    TYPE_ORDER,
    Snapshot,
)
from infergate.gateway.xds_resources import (
    Resources,
    SnapshotError,
    bind_listeners,
    compile_snapshot,
    empty_assignment,
    merge,
    valid_bind_address,
)

log = logging.getLogger("infergate.gateway.xds")

BIND_ADDRESS_KEY = "infergate.io/bind-address"
"""Node metadata key: the IP a proxy's wildcard listeners bind (see the module doc)."""

MAX_RESOURCE_NAMES = 100_000
MAX_MESSAGE_BYTES = 4 << 20

_MAKE, _LISTENERS, _ROUTES, _BREAK, _CLEAN, _DONE = range(6)
_STAGE_TYPES: dict[int, tuple[str, ...]] = {
    _MAKE: (CLUSTER_TYPE, ENDPOINT_TYPE),
    _LISTENERS: (LISTENER_TYPE,),
    _ROUTES: (ROUTE_TYPE,),
    _BREAK: (CLUSTER_TYPE, ROUTE_TYPE),
    _CLEAN: (ENDPOINT_TYPE,),
}
#: Types Envoy asks for as a whole (wildcard); the others by resource name.
_WILDCARD_TYPES = (CLUSTER_TYPE, LISTENER_TYPE)


@dataclass(frozen=True)
class Nack:
    """Envoy rejected a response: which type, which version, why, and which replica."""

    type_url: str
    version: str
    message: str
    replica: str


@dataclass(frozen=True)
class NodeStatus:
    """What the proxies of one node id have, as the operator reads it.

    * ``target``: per type, the version of the node's current snapshot.
    * ``acked``: per type, the version every connected replica has acked (a type is
      missing while replicas disagree or none acked it yet).
    * ``applied``: at least one replica is connected and every one serves ``target``
      completely (every stage done and acked).
    * ``rejected``: a replica NACKed part of ``target``; it keeps its previous config.
    * ``nacks``: the latest NACK per replica and type.
    * ``error``: why the last snapshot given to :meth:`AdsServer.set_snapshot` was
      refused by the server itself (the previous one is still served).
    """

    replicas: int = 0
    target: Mapping[str, str] = field(default_factory=dict)
    acked: Mapping[str, str] = field(default_factory=dict)
    applied: bool = False
    rejected: bool = False
    nacks: tuple[Nack, ...] = ()
    error: str | None = None


StatusListener = Callable[[str, NodeStatus], None]


class StreamError(Exception):
    """A request that ends its stream (no node id, too many names)."""


@dataclass
class _Subscription:
    """One type on one stream: what Envoy asked for, what it was sent, what it acked."""

    subscribed: bool = False
    names: frozenset[str] = frozenset()
    resend: bool = False
    sent_version: str | None = None
    sent_names: frozenset[str] = frozenset()
    nonce: str = ""
    pending: bool = False
    acked: str | None = None
    nack: Nack | None = None


class _Stream:
    """One Envoy's ADS stream: the make-before-break walk towards its node's snapshot."""

    def __init__(
        self, node_id: str, bind_address: str | None, peer: str, wake: asyncio.Event
    ) -> None:
        self.node_id = node_id
        self.bind_address = bind_address
        self.peer = peer
        self.wake = wake
        self.subs = {type_url: _Subscription() for type_url in TYPE_ORDER}
        self.views: dict[str, Resources | None] = dict.fromkeys(TYPE_ORDER)
        self.target: Mapping[str, Resources] | None = None
        self.stage = _DONE
        self.failed = False
        self._nonces = itertools.count(1)
        self._unknown: set[str] = set()

    def retarget(self, target: Mapping[str, Resources]) -> None:
        """Start a walk to ``target`` from whatever this stream serves now."""
        if target is self.target:
            return
        self.target, self.failed = target, False
        self._enter(_MAKE)

    def on_request(self, request: Any) -> None:
        """Record an ACK, a NACK or a (re)subscription; stale requests change nothing."""
        sub = self.subs.get(request.type_url)
        if sub is None:
            self._unknown_type(request.type_url)
            return
        if len(request.resource_names) > MAX_RESOURCE_NAMES:
            raise StreamError(f"more than {MAX_RESOURCE_NAMES} resource names")
        nonce = request.response_nonce
        if nonce and nonce != sub.nonce:
            return  # answers an older response; Envoy will answer the newest one too
        answer = not (nonce and sub.pending)
        if not answer:
            self._on_reply(request, sub)
        names = frozenset(request.resource_names)
        if request.type_url in _WILDCARD_TYPES:
            sub.subscribed = True
        else:
            sub.subscribed = bool(names)
        answer = answer or names != sub.names
        sub.names = names
        sub.resend = sub.resend or answer

    def _on_reply(self, request: Any, sub: _Subscription) -> None:
        sub.pending = False
        if not request.HasField("error_detail"):
            sub.acked, sub.nack = request.version_info, None
            return
        sub.nack = Nack(
            request.type_url, sub.sent_version or "", request.error_detail.message, self.peer
        )
        log.warning(
            "%s (%s) rejected %s version %s: %s",
            self.node_id,
            self.peer,
            request.type_url.rsplit(".", 1)[-1],
            sub.sent_version,
            request.error_detail.message,
        )
        view = self.views[request.type_url]
        if view is not None and view.version == sub.sent_version:
            self.failed = True  # stop the walk here: Envoy keeps what it had

    def step(self) -> list[Any]:
        """Advance the walk as far as Envoy's ACKs allow; the responses to send now."""
        self._advance()
        responses = []
        for type_url in TYPE_ORDER:
            response = self._response(type_url)
            if response is not None:
                responses.append(response)
        return responses

    def applied(self) -> bool:
        """Serving ``target`` completely: walk done, every subscription sent and acked."""
        if self.target is None or self.failed or self.stage != _DONE:
            return False
        if not all(self.subs[type_url].subscribed for type_url in _WILDCARD_TYPES):
            return False
        return all(self._settled(type_url) for type_url in TYPE_ORDER)

    def acked(self) -> dict[str, str]:
        return {
            type_url: sub.acked
            for type_url, sub in self.subs.items()
            if sub.subscribed and sub.acked is not None
        }

    def _advance(self) -> None:
        while not self.failed and self.stage < _DONE:
            if not all(self._settled(type_url) for type_url in _STAGE_TYPES[self.stage]):
                return
            self._enter(self.stage + 1)

    def _enter(self, stage: int) -> None:
        self.stage = stage
        target, views = self.target, self.views
        assert target is not None
        if stage == _MAKE:
            views[CLUSTER_TYPE] = merge(views[CLUSTER_TYPE], target[CLUSTER_TYPE])
            views[ENDPOINT_TYPE] = merge(views[ENDPOINT_TYPE], target[ENDPOINT_TYPE])
        elif stage == _LISTENERS:
            views[LISTENER_TYPE] = target[LISTENER_TYPE]
        elif stage == _ROUTES:
            views[ROUTE_TYPE] = merge(views[ROUTE_TYPE], target[ROUTE_TYPE])
        elif stage in (_BREAK, _CLEAN):
            for type_url in _STAGE_TYPES[stage]:
                views[type_url] = target[type_url]

    def _settled(self, type_url: str) -> bool:
        """Nothing left to send or to hear back for this type (or Envoy does not want it)."""
        sub, view = self.subs[type_url], self.views[type_url]
        if not sub.subscribed:
            return True
        return (
            view is not None
            and not sub.pending
            and not sub.resend
            and sub.sent_version == view.version
            and sub.sent_names == sub.names
        )

    def _response(self, type_url: str) -> Any:
        sub, view = self.subs[type_url], self.views[type_url]
        if view is None or not sub.subscribed or sub.pending:
            return None
        if not sub.resend and sub.sent_version == view.version and sub.sent_names == sub.names:
            return None
        resources = self._resources(type_url, view, sub.names)
        sub.resend, sub.sent_version, sub.sent_names = False, view.version, sub.names
        if resources is None:
            return None
        sub.nonce, sub.pending = str(next(self._nonces)), True
        return discovery_pb2.DiscoveryResponse(
            version_info=view.version, resources=resources, type_url=type_url, nonce=sub.nonce
        )

    def _resources(
        self, type_url: str, view: Resources, names: frozenset[str]
    ) -> list[any_pb2.Any] | None:
        """What to send for ``names``; None when there is nothing worth a response."""
        if type_url == LISTENER_TYPE and self.bind_address:
            return bind_listeners(view, self.bind_address)
        if type_url in _WILDCARD_TYPES:
            return view.select(frozenset())
        if type_url == ENDPOINT_TYPE:
            return [view.packed.get(name) or empty_assignment(name) for name in sorted(names)]
        # Routes: an empty answer would make a warming listener serve no routes at all.
        return view.select(names) or None

    def _unknown_type(self, type_url: str) -> None:
        if type_url not in self._unknown:
            self._unknown.add(type_url)
            log.info("%s asks for %s, which this server does not serve", self.node_id, type_url)


@dataclass
class _Node:
    snapshot: Snapshot | None = None
    target: Mapping[str, Resources] | None = None
    error: str | None = None
    streams: set[_Stream] = field(default_factory=set)
    sequence: int = -1
    versions: dict[str, str] = field(default_factory=dict)


class AdsServer:
    """State-of-the-world ADS for many node ids, each with any number of Envoy replicas.

    Run it on the operator's event loop (``port = await server.start("0.0.0.0:18000")``);
    :meth:`set_snapshot`, :meth:`status` and :meth:`acked` may be called from any thread;
    :meth:`wait_acked` is a coroutine of the server's loop (from another thread use
    ``asyncio.run_coroutine_threadsafe``).
    """

    def __init__(
        self,
        *,
        max_streams: int = 1024,
        first_request_timeout_s: float = 30.0,
        keepalive_s: float = 30.0,
    ) -> None:
        self.max_streams = max_streams
        self.first_request_timeout_s = first_request_timeout_s
        self.keepalive_s = keepalive_s
        self._nodes: dict[str, _Node] = {}
        self._status: dict[str, NodeStatus] = {}
        self._listeners: list[StatusListener] = []
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._lock = threading.Lock()
        self._sequence = itertools.count()

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, address: str = "0.0.0.0:18000") -> int:
        """Listen on ``address`` (``host:port``; port 0 picks one); returns the port."""
        self._loop = asyncio.get_running_loop()
        server = grpc.aio.server(
            options=self._grpc_options(), maximum_concurrent_rpcs=self.max_streams
        )
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_Servicer(self), server)
        port = server.add_insecure_port(address)
        await server.start()
        self._server = server
        log.info("ADS server listening on %s (port %d)", address, port)
        return int(port)

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Close every stream; Envoys keep their config and reconnect with backoff."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    def _grpc_options(self) -> list[tuple[str, Any]]:
        keepalive_ms = int(self.keepalive_s * 1000)
        return [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # Dead proxies (a node that vanished without a FIN) are found and dropped.
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", 10_000),
            # Envoy pings too (the bootstrap's connection_keepalive); gRPC's default
            # would answer its pings with GOAWAY "too_many_pings".
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", min(keepalive_ms, 10_000)),
            ("grpc.http2.max_pings_without_data", 0),
            # Never share the port with another server by accident.
            ("grpc.so_reuseport", 0),
        ]

    # -- snapshots ---------------------------------------------------------------------

    def set_snapshot(self, node_id: str, snapshot: Snapshot) -> bool:
        """Make ``snapshot`` the config of every proxy of ``node_id``.

        Returns False, logs why and keeps the previous snapshot when a resource is not
        valid Envoy config. A snapshot with the same versions as the current one changes
        nothing and sends nothing."""
        # Numbered on entry: of two racing calls the later one wins, not the one whose
        # conversion happened to finish last.
        sequence = next(self._sequence)
        node = self._nodes.get(node_id)
        if node is not None and node.versions and node.versions == _versions(snapshot):
            self._submit(sequence, self._clear_error, node_id)
            return True
        try:
            target = compile_snapshot(snapshot)
        except SnapshotError as error:
            log.error("snapshot for %s refused, keeping the previous one: %s", node_id, error)
            self._submit(sequence, self._set_error, node_id, str(error))
            return False
        self._submit(sequence, self._install, node_id, snapshot, target)
        return True

    def remove_snapshot(self, node_id: str) -> None:
        """Forget ``node_id`` (its Gateway is gone); connected proxies keep their config."""
        self._submit(next(self._sequence), self._remove, node_id)

    def snapshot(self, node_id: str) -> Snapshot | None:
        node = self._nodes.get(node_id)
        return node.snapshot if node is not None else None

    # -- what the proxies have ---------------------------------------------------------

    def status(self, node_id: str) -> NodeStatus:
        return self._status.get(node_id) or NodeStatus()

    def acked(self, node_id: str) -> dict[str, str]:
        """Per type, the version every connected replica of ``node_id`` acked."""
        return dict(self.status(node_id).acked)

    def add_listener(self, listener: StatusListener) -> None:
        """Call ``listener(node_id, status)`` (on the server's loop) when a status changes."""
        self._listeners.append(listener)

    async def wait_acked(
        self, node_id: str, snapshot: Snapshot | None = None, timeout: float | None = None
    ) -> bool:
        """True once every connected replica of ``node_id`` serves ``snapshot`` (default:
        the current one) completely; False at ``timeout`` or as soon as a replica NACKed
        it (see :meth:`status` for the NACK)."""
        want = _versions(snapshot) if snapshot is not None else None

        async def until() -> bool:
            while True:
                changed = self._changed
                status = self.status(node_id)
                target = want if want is not None else dict(status.target)
                if target and dict(status.target) == target:
                    if status.applied:
                        return True
                    if status.rejected:
                        return False
                await changed.wait()

        try:
            return await asyncio.wait_for(until(), timeout)
        except TimeoutError:
            return False

    # -- on the loop -------------------------------------------------------------------

    def _submit(
        self, sequence: int, function: Callable[..., None], node_id: str, *args: Any
    ) -> None:
        """``function(node_id, *args)`` on the loop, unless a later call already landed."""

        def apply() -> None:
            node = self._nodes.setdefault(node_id, _Node())
            if sequence < node.sequence:
                return
            node.sequence = sequence
            function(node_id, *args)

        self._call(apply)

    def _call(self, function: Callable[..., None], *args: Any) -> None:
        """Run ``function`` on the server's loop (now, when already on it or not started)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            with self._lock:
                function(*args)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            function(*args)
        else:
            loop.call_soon_threadsafe(function, *args)

    def _install(self, node_id: str, snapshot: Snapshot, target: Mapping[str, Resources]) -> None:
        node = self._nodes[node_id]
        node.snapshot, node.target, node.error = snapshot, target, None
        node.versions = {type_url: resources.version for type_url, resources in target.items()}
        for stream in node.streams:
            stream.retarget(target)
            stream.wake.set()
        self._publish(node_id)

    def _set_error(self, node_id: str, error: str) -> None:
        self._nodes[node_id].error = error
        self._publish(node_id)

    def _clear_error(self, node_id: str) -> None:
        node = self._nodes.get(node_id)
        if node is not None and node.error is not None:
            node.error = None
            self._publish(node_id)

    def _remove(self, node_id: str) -> None:
        node = self._nodes.get(node_id)
        if node is None:
            return
        node.snapshot = node.target = node.error = None
        node.versions = {}
        if not node.streams:
            del self._nodes[node_id]
        self._publish(node_id)

    def _open(self, request: Any, peer: str, wake: asyncio.Event) -> _Stream:
        node_id = request.node.id
        if not node_id or len(node_id) > 1024:
            raise StreamError("the first request must carry node.id (at most 1024 bytes)")
        stream = _Stream(node_id, _bind_address(request, node_id), peer, wake)
        node = self._nodes.setdefault(node_id, _Node())
        node.streams.add(stream)
        if node.target is not None:
            stream.retarget(node.target)
        log.info("%s connected from %s", node_id, peer)
        return stream

    def _close(self, stream: _Stream) -> None:
        node = self._nodes.get(stream.node_id)
        if node is None:
            return
        node.streams.discard(stream)
        if not node.streams and node.snapshot is None and node.error is None:
            del self._nodes[stream.node_id]
        log.info("%s disconnected (%s)", stream.node_id, stream.peer)
        self._publish(stream.node_id)

    def _publish(self, node_id: str) -> None:
        """Recompute a node's status; wake waiters and tell listeners if it changed."""
        status = _node_status(self._nodes.get(node_id))
        if self._status.get(node_id) == status:
            return
        if status == NodeStatus():
            self._status.pop(node_id, None)
        else:
            self._status[node_id] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for listener in list(self._listeners):
            try:
                listener(node_id, status)
            except Exception:
                log.exception("ADS status listener failed")


class _Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """The gRPC face of :class:`AdsServer` (Delta xDS is left UNIMPLEMENTED)."""

    def __init__(self, server: AdsServer) -> None:
        self._server = server

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        connection = _Connection()
        reader = asyncio.create_task(self._read(connection, request_iterator, context.peer()))
        try:
            try:
                await asyncio.wait_for(connection.wake.wait(), self._server.first_request_timeout_s)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no first request")
            while True:
                await connection.wake.wait()
                connection.wake.clear()
                if connection.error is not None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, connection.error)
                stream = connection.stream
                if connection.done or stream is None:
                    return
                for response in stream.step():
                    yield response
                self._server._publish(stream.node_id)
        finally:
            reader.cancel()
            if connection.stream is not None:
                self._server._close(connection.stream)

    async def _read(self, connection: _Connection, requests: AsyncIterator[Any], peer: str) -> None:
        """Apply each request to the stream's state and wake the writer."""
        try:
            async for request in requests:
                if connection.stream is None:
                    connection.stream = self._server._open(request, peer, connection.wake)
                connection.stream.on_request(request)
                self._server._publish(connection.stream.node_id)
                connection.wake.set()
        except StreamError as error:
            connection.error = str(error)
        except DecodeError as error:  # one line, not a task's traceback
            log.warning("ADS stream from %s: corrupt frame (%s)", peer, error)
            connection.error = "corrupt DiscoveryRequest"
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the client went away mid-read, and the like
            log.debug("ADS stream from %s ended: %r", peer, error)
        finally:
            connection.done = True
            connection.wake.set()


class _Connection:
    """A gRPC stream before and after its first request told us whose it is."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.stream: _Stream | None = None
        self.error: str | None = None
        self.done = False


def _versions(snapshot: Snapshot) -> dict[str, str]:
    return {type_url: snapshot.version(type_url) for type_url in TYPE_ORDER}


def _bind_address(request: Any, node_id: str) -> str | None:
    field_ = request.node.metadata.fields.get(BIND_ADDRESS_KEY)
    if field_ is None or not field_.string_value:
        return None
    address = valid_bind_address(field_.string_value)
    if address is None:
        log.warning(
            "%s: node metadata %s=%r is not an IP; its listeners keep their addresses",
            node_id,
            BIND_ADDRESS_KEY,
            field_.string_value,
        )
    return address


def _node_status(node: _Node | None) -> NodeStatus:
    if node is None:
        return NodeStatus()
    streams = list(node.streams)
    return NodeStatus(
        replicas=len(streams),
        target=dict(node.versions),
        acked=_agreed([stream.acked() for stream in streams]),
        applied=bool(streams) and all(stream.applied() for stream in streams),
        rejected=any(stream.failed and stream.target is node.target for stream in streams),
        nacks=tuple(
            sub.nack
            for stream in sorted(streams, key=lambda s: s.peer)
            for sub in stream.subs.values()
            if sub.nack is not None
        ),
        error=node.error,
    )


def _agreed(per_replica: list[dict[str, str]]) -> dict[str, str]:
    """The type versions all replicas share."""
    if not per_replica:
        return {}
    agreed = dict(per_replica[0])
    for acked in per_replica[1:]:
        agreed = {t: v for t, v in agreed.items() if acked.get(t) == v}
    return agreed
