"""Flow-control metrics: GIE's names where GIE has them, ours (``infergate_epp_flow_control_``)
for the rest.

Queue gauges are read from the live queues at scrape time (a collector), so a flow that
emptied has no series left behind and an enqueue costs no metric update. Counters and the
queue-duration histogram are labelled by priority (and outcome / reason), never by
fairness ID: tenants are unbounded, label sets must not be. The histogram is a
:class:`~infergate.epp.loop_histogram.LoopHistogram`: dispatches happen on the loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from infergate.epp.loop_histogram import LoopHistogram
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from infergate.epp.flowcontrol.controller import FlowController

QUEUE_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip


class _QueueGauges(Collector):
    def __init__(self, owner: FlowControlMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        controller = self.owner.controller
        pool = self.owner.pool_name
        size = GaugeMetricFamily(
            "inference_extension_flow_control_queue_size",
            "Requests waiting in flow control, per fairness flow and priority band.",
            labels=["fairness_id", "priority", "inference_pool"],
        )
        nbytes = GaugeMetricFamily(
            "inference_extension_flow_control_queue_bytes",
            "Bytes of request bodies waiting in flow control, per fairness flow and band.",
            labels=["fairness_id", "priority", "inference_pool"],
        )
        age = GaugeMetricFamily(
            "infergate_epp_flow_control_queue_oldest_age_seconds",
            "Age of the oldest waiting request per priority band.",
            labels=["priority"],
        )
        in_flight = GaugeMetricFamily(
            "infergate_epp_flow_control_in_flight_requests",
            "Requests flow control dispatched that have not finished.",
        )
        if controller is not None:
            now = controller.clock()
            for priority, band in controller.queues.bands.items():
                oldest = None
                for flow in band.flows.values():
                    head = next(iter(flow.items.values()), None)
                    if head is None:
                        continue
                    oldest = head.enqueued if oldest is None else min(oldest, head.enqueued)
                    labels = [flow.fairness_id, str(priority), pool]
                    size.add_metric(labels, len(flow.items))
                    nbytes.add_metric(labels, flow.bytes)
                if oldest is not None:
                    age.add_metric([str(priority)], now - oldest)
            in_flight.add_metric([], controller.in_flight)
        yield from (size, nbytes, age, in_flight)


class FlowControlMetrics:
    def __init__(self, registry: CollectorRegistry, pool_name: str = "local") -> None:
        self.pool_name = pool_name
        self.controller: FlowController | None = None
        self.queue_duration = LoopHistogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time requests spent in the flow-control queue, by priority and outcome.",
            ["priority", "outcome", "inference_pool"],
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.dispatches = Counter(
            "infergate_epp_flow_control_dispatches",
            "Requests dispatched from the flow-control queue, by priority.",
            ["priority"],
            registry=registry,
        )
        self.rejections = Counter(
            "infergate_epp_flow_control_rejections",
            "Requests that left flow control undispatched, by priority and reason "
            "(queue_full and ttl_expired answer 429; cancelled: the client went away).",
            ["priority", "reason"],
            registry=registry,
        )
        registry.register(_QueueGauges(self))

    def bind(self, controller: FlowController) -> None:
        self.controller = controller

    def dispatched(self, priority: int, waited: float) -> None:
        self.dispatches.labels(str(priority)).inc()
        self.queue_duration.labels(str(priority), "dispatched", self.pool_name).observe(waited)

    def rejected(self, priority: int, reason: str, waited: float | None = None) -> None:
        self.rejections.labels(str(priority), reason).inc()
        if waited is not None:
            self.queue_duration.labels(str(priority), reason, self.pool_name).observe(waited)
