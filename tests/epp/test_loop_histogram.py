"""LoopHistogram exposes what prometheus-client's own Histogram would, for the same data."""

from __future__ import annotations

import random

import pytest
from infergate.epp.loop_histogram import LoopHistogram
from prometheus_client import CollectorRegistry, Histogram, generate_latest

BUCKETS = (0.0, 0.001, 0.01, 0.1, 1.0, 10.0)


def _samples(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without ``_created`` (ours has none)."""
    text = generate_latest(registry).decode()
    return sorted(
        line for line in text.splitlines() if not line.startswith("#") and "_created" not in line
    )


def test_same_exposition_as_prometheus_client() -> None:
    """Random observations, on bucket bounds too (``le`` is inclusive), labelled and not."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("t_seconds", "doc", ["a"], buckets=BUCKETS, registry=ours)
    ref = Histogram("t_seconds", "doc", ["a"], buckets=BUCKETS, registry=theirs)
    plain = LoopHistogram("u", "doc", buckets=BUCKETS, registry=ours)
    plain_ref = Histogram("u", "doc", buckets=BUCKETS, registry=theirs)
    rng = random.Random(7)
    scales = (1e-4, 0.05, 3.0)
    values = [*BUCKETS, 20.0, -1.0] + [rng.choice(scales) * rng.random() for _ in range(500)]
    for value in values:
        label = rng.choice(("x", "y"))
        mine.labels(label).observe(value)
        ref.labels(label).observe(value)
        plain.observe(value)
        plain_ref.observe(value)
    assert _samples(ours) == _samples(theirs)
    assert ours.get_sample_value("u_count") == len(values)


def test_bad_buckets_and_labels_are_refused() -> None:
    registry = CollectorRegistry()
    with pytest.raises(ValueError, match="ascending"):
        LoopHistogram("b", "doc", buckets=(1.0, 0.5), registry=registry)
    histogram = LoopHistogram("c", "doc", ["a", "b"], buckets=BUCKETS, registry=registry)
    with pytest.raises(ValueError, match="expected labels"):
        histogram.labels("only-one")
    with pytest.raises(ValueError, match="use labels"):
        histogram.observe(1.0)
    with pytest.raises(ValueError, match="Duplicated"):
        LoopHistogram("c", "doc", ["a", "b"], buckets=BUCKETS, registry=registry)
