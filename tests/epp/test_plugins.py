"""The math of every scheduling plugin, on hand-built endpoint states."""

from __future__ import annotations

import base64
import random
import time
from collections import Counter

import pytest
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.framework.requestcontrol import ResponseInfo
from infergate.epp.framework.scheduling import SchedulingResult
from infergate.epp.scheduling.plugins import REGISTRY, PluginContext
from infergate.epp.scheduling.prefix_index import PrefixIndex, block_hashes
from infergate.epp.types import CycleState, Endpoint, EndpointState, InferenceRequest, Metrics


def state(
    i: int, waiting: int = 0, running: int = 0, kv: float = 0.0, fresh: bool = True, **kw: object
) -> EndpointState:
    metrics = Metrics(
        waiting=waiting,
        running=running,
        kv_usage=kv,
        updated_at=time.monotonic() if fresh else 0.0,
        **kw,  # type: ignore[arg-type]
    )
    return EndpointState(Endpoint(f"10.0.0.{i}", 8000), metrics)


def make(type_name: str, datastore: Datastore | None = None, **params: object):
    cls = REGISTRY[type_name]
    context = PluginContext(datastore or Datastore(), SaturationDetector(5, 0.8, 2.0))
    return cls(type_name, cls.Params.model_validate(params), context)


def req(**kw: object) -> InferenceRequest:
    r = InferenceRequest("r", {})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_queue_scorer_minmax() -> None:
    eps = [state(1, waiting=0), state(2, waiting=5), state(3, waiting=10)]
    assert make("queue-scorer").score(CycleState(), req(), eps) == [1.0, 0.5, 0.0]
    same = [state(1, waiting=3), state(2, waiting=3)]
    assert make("queue-scorer").score(CycleState(), req(), same) == [1.0, 1.0]


def test_running_and_kv_scorers() -> None:
    eps = [state(1, running=2, kv=0.25), state(2, running=6, kv=1.0)]
    assert make("running-requests-scorer").score(CycleState(), req(), eps) == [1.0, 0.0]
    assert make("kv-cache-utilization-scorer").score(CycleState(), req(), eps) == [0.75, 0.0]


def test_token_load_scorer_tracks_in_flight_tokens() -> None:
    plugin = make("token-load-scorer")
    a, b = state(1), state(2)
    r = req(prompt_tokens_estimate=100, max_tokens=50)
    result = SchedulingResult("p", [a])
    plugin.pre_request(CycleState(), r, result)
    assert a.in_flight_tokens == 150
    assert plugin.score(CycleState(), r, [a, b]) == [0.0, 1.0]
    plugin.response_complete(r, result, ResponseInfo())
    assert a.in_flight_tokens == 0
    assert plugin.score(CycleState(), r, [a, b]) == [1.0, 1.0]


def test_lora_affinity_levels() -> None:
    eps = [
        state(1, active_models=frozenset({"sql"}), max_active_models=1),
        state(2, active_models=frozenset({"x"}), max_active_models=2),
        state(
            3,
            active_models=frozenset({"x"}),
            waiting_models=frozenset({"sql"}),
            max_active_models=2,
        ),
        state(4, active_models=frozenset({"x"}), max_active_models=1),
    ]
    assert make("lora-affinity-scorer").score(CycleState(), req(target_model="sql"), eps) == [
        1.0,
        0.8,
        0.6,
        0.0,
    ]


def test_prefix_hashing_chains_and_salts() -> None:
    text = b"a" * 64 + b"b" * 64 + b"c" * 10
    hashes = block_hashes("m", "", text, 64, 256)
    assert len(hashes) == 3  # two full blocks and the partial tail
    assert block_hashes("m", "", text[:128], 64, 256) == hashes[:2]  # a prefix shares hashes
    assert block_hashes("other-model", "", text, 64, 256)[0] != hashes[0]
    assert block_hashes("m", "tenant", text, 64, 256)[0] != hashes[0]
    assert block_hashes("m", "", b"b" * 64 + b"a" * 64, 64, 256)[1] != hashes[1]  # chained
    assert len(block_hashes("m", "", text, 64, 2)) == 2  # capped match length
    assert block_hashes("m", "", b"short", 64, 256) == []


def test_prefix_index_lru_and_match() -> None:
    index = PrefixIndex(capacity_per_server=3)
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2])
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    index.add("a", [9])  # evicts the least recently used (1)
    assert index.size("a") == 3
    assert index.match([1, 2, 3]) == {"b": 2}
    index.clear_server("b")
    assert index.match([1, 2]) == {}


async def test_prefix_scorer_records_at_pre_request() -> None:
    ds = Datastore()
    a, b = state(1), state(2)
    plugin = make("prefix-cache-scorer", ds, blockSizeTokens=4)  # 16 characters per block
    r = req(prompt_text="x" * 64, target_model="m")
    cycle = CycleState()
    await plugin.prepare(cycle, r, [a, b])
    assert plugin.score(cycle, r, [a, b]) == [0.0, 0.0]
    plugin.pre_request(cycle, r, SchedulingResult("p", [b]))
    longer = req(prompt_text="x" * 64 + "y" * 64, target_model="m")
    cycle = CycleState()
    await plugin.prepare(cycle, longer, [a, b])
    assert plugin.score(cycle, longer, [a, b]) == [0.0, 0.5]


def test_no_hit_lru_spreads_cold_requests() -> None:
    plugin = make("no-hit-lru-scorer")
    a, b, c = state(1), state(2), state(3)
    cold = CycleState()
    assert plugin.score(cold, req(), [a, b, c]) == [1.0, 1.0, 1.0]
    plugin.pre_request(cold, req(), SchedulingResult("p", [a]))
    scores = plugin.score(CycleState(), req(), [a, b, c])
    assert scores[1] == scores[2] == 1.0 and scores[0] < 1.0
    warm = CycleState({"prefix.max_match": 3})
    assert plugin.score(warm, req(), [a, b, c]) == [0.5, 0.5, 0.5]


def test_session_affinity_round_trip() -> None:
    plugin = make("session-affinity-scorer")
    a, b = state(1), state(2)
    headers = plugin.response_headers(req(), SchedulingResult("p", [b]), ResponseInfo())
    token = headers["x-session-token"]
    assert base64.urlsafe_b64decode(token).decode() == b.key
    r = req(headers={"x-session-token": token})
    assert plugin.score(CycleState(), r, [a, b]) == [0.0, 1.0]
    assert plugin.score(CycleState(), req(headers={"x-session-token": "%%%"}), [a, b]) == [0.0, 0.0]


def test_max_score_picker_breaks_ties_randomly() -> None:
    random.seed(7)
    picker = make("max-score-picker")
    eps = [state(1), state(2), state(3)]
    picks = Counter(
        picker.pick(CycleState(), req(), eps, [1.0, 1.0, 0.2])[0].key for _ in range(200)
    )
    assert set(picks) == {eps[0].key, eps[1].key}
    top2 = make("max-score-picker", maxNumOfEndpoints=2).pick(
        CycleState(), req(), eps, [0.1, 0.9, 0.5]
    )
    assert [e.key for e in top2] == [eps[1].key, eps[2].key]


def test_random_and_weighted_random_pickers() -> None:
    random.seed(3)
    eps = [state(1), state(2), state(3)]
    seen = Counter(
        make("random-picker").pick(CycleState(), req(), eps, [0, 0, 1])[0].key for _ in range(300)
    )
    assert len(seen) == 3
    weighted = make("weighted-random-picker")
    counts = Counter(
        weighted.pick(CycleState(), req(), eps, [0.0, 1.0, 3.0])[0].key for _ in range(2000)
    )
    assert eps[0].key not in counts
    assert 2.0 < counts[eps[2].key] / counts[eps[1].key] < 4.5
    assert len(weighted.pick(CycleState(), req(), eps, [0.0, 0.0, 0.0])) == 1


def test_saturation_detector_and_filter() -> None:
    detector = SaturationDetector(queue_threshold=5, kv_threshold=0.8, staleness=2.0)
    assert not detector.is_saturated(state(1, waiting=4, kv=0.79))
    assert detector.is_saturated(state(1, waiting=5))
    assert detector.is_saturated(state(1, kv=0.8))
    assert detector.is_saturated(state(1, fresh=False))  # never scraped = stale = saturated
    filt = make("saturation-filter")
    ok, busy = state(1), state(2, waiting=9)
    assert filt.filter(CycleState(), req(), [ok, busy]) == [ok]
    assert filt.filter(CycleState(), req(), [busy]) == [busy]  # fails open


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("10.0.0.2", ["10.0.0.2:8000"]),
        ("10.0.0.3:8000, 10.0.0.1:8000", ["10.0.0.3:8000", "10.0.0.1:8000"]),
        ("10.0.0.1:9999", []),  # names nothing of this pool: no candidate (503)
        ("10.9.9.9", []),
    ],
)
def test_header_based_testing_filter(header: str, expected: list[str]) -> None:
    filt = make("header-based-testing-filter")
    eps = [state(1), state(2), state(3)]
    cycle = CycleState()
    kept = filt.filter(cycle, req(headers={"test-epp-endpoint-selection": header}), eps)
    assert [e.key for e in kept] == expected
    if expected:  # the picker honours the header's order
        picked = make("max-score-picker").pick(cycle, req(), kept, [0.0] * len(kept))
        assert picked[0].key == expected[0]


@pytest.mark.parametrize("headers", [{}, {"test-epp-endpoint-selection": ""}])
def test_header_based_testing_filter_without_a_selection_keeps_every_endpoint(
    headers: dict[str, str],
) -> None:
    """GIE's reference conformance EPP routes a request without the header to any pod of
    the pool (HTTPRouteMultipleGatewaysDifferentPools sends such requests)."""
    filt = make("header-based-testing-filter")
    eps = [state(1), state(2), state(3)]
    cycle = CycleState()
    kept = filt.filter(cycle, req(headers=headers), eps)
    assert [e.key for e in kept] == [e.key for e in eps]
    assert "test.selection_order" not in cycle  # the picker then scores as usual
    picks = {
        make("max-score-picker").pick(cycle, req(), kept, [0.0] * 3)[0].key for _ in range(200)
    }
    assert picks == {e.key for e in eps}  # ties are shared: any pod may serve


def test_served_verifier_echoes_metadata() -> None:
    plugin = make("destination-endpoint-served-verifier")
    info = ResponseInfo(
        metadata={"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.1:8000"}}
    )
    assert plugin.response_headers(req(), None, info) == {
        "x-conformance-test-served-endpoint": "10.0.0.1:8000"
    }
    missing = plugin.response_headers(req(), None, ResponseInfo())
    assert missing["x-conformance-test-served-endpoint"].startswith("fail:")
