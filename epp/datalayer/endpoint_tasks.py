"""One background task per endpoint, following the datastore's endpoint set.

Both per-endpoint feeds of the data layer (the metrics scrape loops and the KV-event
subscriptions) need the same lifecycle: a task starts when an endpoint appears, is
cancelled when it goes, and all are cancelled and awaited at stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.types import Endpoint

TaskFactory = Callable[[Endpoint], Coroutine[Any, Any, None]]


class EndpointTasks:
    def __init__(self, datastore: Datastore, factory: TaskFactory, label: str) -> None:
        self.datastore = datastore
        self.factory = factory
        self.label = label
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._running = False
        self.removed_listeners: list[Callable[[Endpoint], None]] = []

    def start(self) -> None:
        """Start a task for every current endpoint and follow changes (needs a running loop)."""
        self._running = True
        self.datastore.subscribe(self._on_change)
        self._on_change([s.endpoint for s in self.datastore.all()], [])

    def _on_change(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for endpoint in removed:
            task = self.tasks.pop(endpoint.key, None)
            if task is not None:
                task.cancel()
            for listener in self.removed_listeners:
                listener(endpoint)
        if not self._running:
            return
        for endpoint in added:
            if endpoint.key not in self.tasks:
                self.tasks[endpoint.key] = asyncio.get_running_loop().create_task(
                    self.factory(endpoint), name=f"{self.label} {endpoint.key}"
                )

    async def stop(self) -> None:
        self._running = False
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class ZmqSubscriptions:
    """One ZMQ SUB task per endpoint (KV events, completion records): the shared asyncio
    context is made at ``start`` and terminated at ``stop``; subclasses write
    ``_subscribe(endpoint)``, which runs for as long as the endpoint is in the pool."""

    def __init__(self, datastore: Datastore, name: str) -> None:
        self._zmq: Any = None
        self._tasks = EndpointTasks(datastore, self._subscribe, name)

    async def _subscribe(self, endpoint: Endpoint) -> None:
        raise NotImplementedError

    def start(self) -> None:
        import zmq.asyncio

        self._zmq = zmq.asyncio.Context()
        self._tasks.start()

    async def stop(self) -> None:
        await self._tasks.stop()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
