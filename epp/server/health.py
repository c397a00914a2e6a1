"""gRPC health (``grpc.health.v1``), whose checks also do the data layer's due housekeeping.

Envoy health-checks the EPP (``epp_health_checks`` in the Envoy bootstrap: a lone EPP
every second, replicas every 5 s): a wakeup it has anyway. The push watch's liveness
check of the engines' load reports would otherwise cost a wakeup of its own about every
second (``datalayer/collector.py``, ``_PushWatch``), ~0.35 ms of CPU each on a shared
core, that every replica paid (docs/benchmarks/scale.md, "Replicas"). So a health check first
runs ``housekeep`` (:meth:`~infergate.epp.datalayer.collector.Collectors.housekeep`):
a refresh of the datastore when that check is due, nothing otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

log = logging.getLogger(__name__)


class HousekeepingHealth(health_aio.HealthServicer):
    """grpc_health's asyncio servicer, running ``housekeep`` before each ``Check``."""

    def __init__(self, housekeep: Callable[[], None]) -> None:
        super().__init__()
        self._housekeep = housekeep

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        try:
            self._housekeep()
        except Exception:  # the check answers whatever housekeeping does
            log.exception("housekeeping at a health check failed")
        return await super().Check(request, context)
