"""Flow control (GIE's ``flowcontrol``): saturation detection, priority bands and fairness
queues that hold requests in the EPP until the pool has capacity (off unless configured)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infergate.epp.datalayer.datastore import Datastore
    from infergate.epp.flowcontrol.config import FlowControlConfig
    from infergate.epp.flowcontrol.controller import FlowController
    from infergate.epp.flowcontrol.saturation import SaturationDetector
    from infergate.epp.observability import EppMetrics


def build_flow_controller(
    config: FlowControlConfig | None,
    datastore: Datastore,
    saturation: SaturationDetector,
    metrics: EppMetrics,
    pool_name: str = "local",
) -> FlowController | None:
    """The flow controller for an EPP, or None when the config leaves flow control off."""
    from infergate.epp.flowcontrol.config import flow_control_config
    from infergate.epp.flowcontrol.controller import FlowController
    from infergate.epp.flowcontrol.metrics import FlowControlMetrics

    parsed = flow_control_config(config)
    if parsed is None:
        return None
    return FlowController(
        parsed, datastore, saturation, FlowControlMetrics(metrics.registry, pool_name)
    )
