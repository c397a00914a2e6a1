"""The Grafana dashboard in docs/ queries only metrics the EPP really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.observability import EppMetrics
from infergate.epp.types import Endpoint
from prometheus_client import generate_latest

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "epp-dashboard.json"
NAME = re.compile(r"\b((?:infergate_epp|inference_(?:pool|objective|extension))_[a-z_]+)")


def test_every_dashboard_query_names_an_exported_metric() -> None:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("10.0.0.1", 8000)])
    metrics = EppMetrics(datastore, SaturationDetector(5, 0.8, 2.0), "pool-a")
    # Touch the labelled families the way a routed request does.
    metrics.requests.labels("routed").inc()
    metrics.request_started("m", "m")
    metrics.request_finished("m", "m", 0.1, 200, 10, 5)
    metrics.observe_prefix_prediction(16.0, 0)
    metrics.plugin_latency.labels("t", "n", "score").observe(0.001)
    metrics.scrape_errors.labels("10.0.0.1:8000").inc()
    exported = generate_latest(metrics.registry).decode()
    names = set(re.findall(r"^([a-z_:]+)", exported, re.MULTILINE))
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in NAME.findall(target["expr"])
    }
    assert len(queried) >= 15
    missing = sorted(q for q in queried if q not in names)
    assert not missing, f"the dashboard queries metrics the EPP does not export: {missing}"
    assert 'inference_pool_ready_pods{name="pool-a"} 1.0' in exported
