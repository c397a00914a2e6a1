"""The candidate-sampling filter: bounded candidates on large pools, holders never lost."""

from __future__ import annotations

import time

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.scheduling.plugins import REGISTRY, PluginContext
from infergate.epp.types import CycleState, Endpoint, InferenceRequest, Metrics


def pool(n: int) -> Datastore:
    ds = Datastore()
    ds.set_endpoints(Endpoint(f"10.0.{i // 250}.{i % 250}", 8000) for i in range(n))
    for state in ds.all():
        state.metrics = Metrics(block_size=16, num_gpu_blocks=600, updated_at=time.monotonic())
    return ds


def sampler(ds: Datastore, **params: object):
    cls = REGISTRY["candidate-sampling-filter"]
    return cls(
        "s", cls.Params.model_validate(params), PluginContext(ds, SaturationDetector(5, 0.8, 2.0))
    )


def test_small_pools_are_kept_whole() -> None:
    ds = pool(64)
    f = sampler(ds)
    states = ds.all()
    assert f.filter(CycleState(), InferenceRequest("r", {}), states) == states


def test_a_large_pool_keeps_every_prefix_holder_plus_a_bounded_random_sample() -> None:
    ds = pool(1000)
    states = ds.all()
    holders = [states[7].key, states[512].key, states[999].key]
    f = sampler(ds, sampleSize=32)
    seen: set[str] = set()
    for _ in range(50):
        cycle = CycleState()
        cycle["prefix.cached_tokens"] = {k: 100.0 for k in holders[:2]}
        cycle["precise.cached_tokens"] = {holders[2]: 50}
        kept = f.filter(cycle, InferenceRequest("r", {}), states)
        keys = [e.key for e in kept]
        assert set(holders) <= set(keys)
        assert len(keys) == len(set(keys)) <= 32 + 3
        assert len(keys) >= 32
        seen.update(keys)
    # The random part moves: 50 draws of 32 out of 1,000 cover far more than one draw.
    assert len(seen) > 300


def test_holders_of_a_narrowed_candidate_list_come_only_from_that_list() -> None:
    """After an earlier filter narrowed the list, a holder outside it is not brought back."""
    ds = pool(400)
    states = ds.all()
    narrowed = states[:200]
    f = sampler(ds, sampleThreshold=10, sampleSize=5)
    cycle = CycleState()
    cycle["prefix.cached_tokens"] = {states[300].key: 10.0, states[3].key: 10.0}
    kept = {e.key for e in f.filter(cycle, InferenceRequest("r", {}), narrowed)}
    assert states[3].key in kept and states[300].key not in kept
    assert kept <= {e.key for e in narrowed}


def test_endpoints_running_the_requested_adapter_are_kept() -> None:
    ds = pool(500)
    states = ds.all()
    for i in (10, 20, 30):
        states[i].metrics.active_models = frozenset({"sql-lora"})
    states[40].metrics.waiting_models = frozenset({"sql-lora"})
    f = sampler(ds, sampleSize=8)
    kept = {
        e.key for e in f.filter(CycleState(), InferenceRequest("r", {}, model="sql-lora"), states)
    }
    assert {states[i].key for i in (10, 20, 30, 40)} <= kept
    other = {e.key for e in f.filter(CycleState(), InferenceRequest("r", {}, model="base"), states)}
    assert len(other) == 8
