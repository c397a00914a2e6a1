"""The pool's endpoints as the EPP currently knows them, with live metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from infergate.epp.types import Endpoint, EndpointState

log = logging.getLogger("infergate.epp.datalayer.datastore")

Listener = Callable[[list[Endpoint], list[Endpoint]], None]
Refresher = Callable[[], None]


class Datastore:
    """Endpoints keyed by ``ip:port``; discovery replaces the set, collectors update metrics."""

    def __init__(self) -> None:
        self._states: dict[str, EndpointState] = {}
        self._listeners: list[Listener] = []
        self._list_cache: list[EndpointState] | None = None
        self._refreshers: list[Refresher] = []

    def subscribe(self, listener: Listener) -> None:
        """``listener(added, removed)`` runs after each change of the endpoint set."""
        self._listeners.append(listener)

    def on_refresh(self, refresher: Refresher) -> None:
        """``refresher()`` runs at each :meth:`refresh` (a feed read lazily)."""
        self._refreshers.append(refresher)

    def refresh(self) -> None:
        """Apply what the lazily read feeds hold (the engines' load reports, the other
        replicas' admission records; see ``completions.py``).

        Whoever is about to read the endpoints' metrics for a decision calls this first
        (the Director, flow control's dispatch, the collector's liveness check): the
        decision then sees each engine's newest report, and a feed costs a read per
        decision instead of a wakeup per message.
        """
        for refresher in self._refreshers:
            try:
                refresher()
            except Exception:  # a feed's bug must not fail the decision
                log.exception("datastore refresher failed")

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        wanted = {endpoint.key: endpoint for endpoint in endpoints}
        removed = [s.endpoint for k, s in self._states.items() if k not in wanted]
        added: list[Endpoint] = []
        for key, endpoint in wanted.items():
            current = self._states.get(key)
            if current is None:
                self._states[key] = EndpointState(endpoint)
                added.append(endpoint)
            elif current.endpoint != endpoint:  # labels changed: keep metrics and accounting
                removed.append(current.endpoint)
                current.endpoint = endpoint
                added.append(endpoint)
        for endpoint in removed:
            if endpoint.key not in wanted:
                self._states.pop(endpoint.key, None)
        if not added and not removed:
            return
        self._list_cache = None
        log.info("endpoints now %d (+%s -%s)", len(self._states), _keys(added), _keys(removed))
        for listener in self._listeners:
            try:
                listener(added, removed)
            except Exception:  # a listener bug must not break discovery
                log.exception("endpoint listener failed")

    def get(self, key: str) -> EndpointState | None:
        return self._states.get(key)

    def all(self) -> list[EndpointState]:
        if self._list_cache is None:
            self._list_cache = list(self._states.values())
        return self._list_cache

    def __len__(self) -> int:
        return len(self._states)


def _keys(endpoints: list[Endpoint], shown: int = 8) -> str:
    """A log-sized list: a 1,000-endpoint pool must not log a 20 KB line per change."""
    keys = ",".join(e.key for e in endpoints[:shown]) or "0"
    return keys if len(endpoints) <= shown else f"{keys},… {len(endpoints)} in all"
