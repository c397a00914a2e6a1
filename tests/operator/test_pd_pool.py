"""A pool declares prefill/decode disaggregation; the operator generates the P/D config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from infergate.epp.config import parse_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.scheduling.plugins import PluginContext
from infergate.epp.scheduling.scheduler import Scheduler

from infergate.operator import constants as c
from infergate.operator.builders import desired_objects
from infergate.operator.pool import InvalidPool, PoolSpec, parse_pool
from infergate.operator.reconcile import resolve_epp_config
from infergate.operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings()


def spec(**annotations: str) -> PoolSpec:
    pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool["metadata"].update(uid="u-1", generation=3, annotations=annotations)
    return parse_pool(pool, SETTINGS)


def test_pd_pool_gets_the_pd_config_with_its_threshold() -> None:
    pool = spec(
        **{c.ANNOTATION_DISAGGREGATION: "prefill-decode", c.ANNOTATION_PD_THRESHOLD: "1024"}
    )
    assert pool.pd_threshold == 1024
    kube: Any = None  # the P/D config needs nothing from the API server
    text = resolve_epp_config(kube, pool)
    config = parse_config(text)
    handler = next(p for p in config.plugins if p.type == "pd-profile-handler")
    assert handler.parameters is not None and handler.parameters["threshold"] == 1024
    scheduler = Scheduler.from_config(
        config, PluginContext(Datastore(), SaturationDetector(5, 0.8, 2.0))
    )
    assert scheduler.profile_names == ["decode", "prefill"]
    (config_map, *_) = desired_objects(pool, SETTINGS, text)
    assert "pd-profile-handler" in config_map["data"][c.EPP_CONFIG_KEY]


def test_pd_default_threshold_and_plain_pool() -> None:
    assert spec(**{c.ANNOTATION_DISAGGREGATION: "prefill-decode"}).pd_threshold == 256
    assert spec().pd_threshold is None


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({c.ANNOTATION_DISAGGREGATION: "prefill-only"}, "must be prefill-decode or none"),
        (
            {c.ANNOTATION_DISAGGREGATION: "prefill-decode", c.ANNOTATION_PD_THRESHOLD: "-5"},
            "must be a whole number",
        ),
        (
            {c.ANNOTATION_DISAGGREGATION: "prefill-decode", c.ANNOTATION_PD_THRESHOLD: "lots"},
            "must be a whole number",
        ),
        ({c.ANNOTATION_PD_THRESHOLD: "100"}, "needs infergate.io/disaggregation"),
        (
            {c.ANNOTATION_DISAGGREGATION: "prefill-decode", c.ANNOTATION_EPP_CONFIG: "mine"},
            "both set",
        ),
    ],
)
def test_bad_pd_annotations(annotations: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidPool, match=message):
        spec(**annotations)
