"""The pool's endpoints served to Envoy over EDS (state of the world, v3).

Envoy's ``override_host`` load-balancing policy — the one Envoy built for GIE's protocol —
only routes to hosts its cluster already has, and only with it does Envoy walk down the
EPP's fallback list (``ip:port,ip:port``) on retries, or fail open over known endpoints
when the EPP is gone. The EPP already tracks the pool's endpoints (Kubernetes, file or
static discovery), so it is the natural source: Envoy's pool cluster subscribes here, on
the ext-proc port, and keeps the last assignment if the EPP dies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from envoy.config.core.v3 import address_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.types import Endpoint

log = logging.getLogger(__name__)

TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def load_assignment(cluster_name: str, endpoints: list[Endpoint]) -> Any:
    """One locality holding every endpoint the EPP knows, in a stable order."""
    lb_endpoints = [
        endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(
                address=address_pb2.Address(
                    socket_address=address_pb2.SocketAddress(
                        address=endpoint.address.strip("[]"), port_value=endpoint.port
                    )
                )
            )
        )
        for endpoint in sorted(endpoints, key=lambda e: e.key)
    ]
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster_name,
        endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb_endpoints)],
    )


class EndpointDiscovery(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """Pushes a new version to every subscribed Envoy whenever the endpoint set changes.

    A pool has one endpoint set, so every cluster name Envoy asks for gets the same hosts.
    """

    def __init__(self, datastore: Datastore) -> None:
        self._datastore = datastore
        self.version = 1
        self._changed = asyncio.Event()
        datastore.subscribe(self._on_change)

    def _on_change(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def response(self, names: list[str], nonce: int) -> Any:
        endpoints = [state.endpoint for state in self._datastore.all()]
        resources = []
        for name in names:
            packed = any_pb2.Any()
            packed.Pack(load_assignment(name, endpoints))
            resources.append(packed)
        return discovery_pb2.DiscoveryResponse(
            version_info=str(self.version),
            resources=resources,
            type_url=TYPE_URL,
            nonce=str(nonce),
        )

    async def StreamEndpoints(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        names: list[str] = []
        sent_version = 0
        nonce = 0
        requests: asyncio.Queue[Any] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await requests.put(request)
            except DecodeError as error:  # one line, not a task's traceback
                log.warning("EDS stream from %s: corrupt frame (%s)", context.peer(), error)
            finally:
                await requests.put(_END)

        reader = asyncio.create_task(read())
        try:
            while True:
                if names and sent_version != self.version:
                    nonce += 1
                    sent_version = self.version
                    yield self.response(names, nonce)
                    continue
                changed = self._changed if names else None
                item = await _next_request(requests, changed)
                if item is _END:
                    return
                if item is None:  # the endpoints changed: the loop's top sends them
                    continue
                if item.HasField("error_detail"):
                    log.warning(
                        "Envoy rejected endpoints version %s: %s",
                        item.version_info,
                        item.error_detail.message,
                    )
                if list(item.resource_names) != names:
                    names = list(item.resource_names)
                    sent_version = 0  # new subscription: answer it
                # else an ACK or NACK of what was sent: nothing new to say
        finally:
            reader.cancel()


_END = object()


async def _next_request(requests: asyncio.Queue[Any], changed: asyncio.Event | None) -> Any:
    """Envoy's next request, or None as soon as ``changed`` is set."""
    if not requests.empty() or changed is None:
        return await requests.get()
    getter = asyncio.ensure_future(requests.get())
    waiter = asyncio.ensure_future(changed.wait())
    await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if getter.done():
        return getter.result()
    getter.cancel()  # a cancelled Queue.get leaves its item in the queue
    return None
