"""A Prometheus histogram for the event loop's thread: an observation takes no lock.

Why: a routed request observes about 18 histograms (each plugin's time per extension
point, the scheduling time, GIE's request duration, token counts and prefix-hit ratios).
prometheus-client's ``Histogram.observe`` scans its buckets in Python and takes a lock for
the bucket and another for the sum: in process, about a tenth of the EPP's CPU per request
went there. Here an observation is a bisection and two list updates.

Why no lock is needed: every observation comes from the loop's thread, so no update is
lost, and the exposition thread reads a copy of a child's list, made by one C call under
the GIL: counts and sum from one instant. That instant may fall between an observation's
two updates (its count in, its amount not yet in the sum): at most one observation, off
by its amount until the next scrape. Not for metrics that other threads update.

The math: ``bounds`` are the buckets' upper bounds, ascending; an observation ``x`` counts
in the first bucket with ``x <= bound`` (``bisect_left``), or in ``+Inf``. Exposed buckets
are cumulative, as Prometheus requires: ``le=bounds[i]`` counts every ``x <= bounds[i]``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class HistogramChild:
    """One label set's buckets: ``cells`` holds a count per bucket, ``+Inf`` last, then
    the sum of observations."""

    __slots__ = ("bounds", "cells")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.cells: list[float] = [0] * (len(bounds) + 1) + [0.0]

    def observe(self, amount: float) -> None:
        cells = self.cells
        cells[bisect_left(self.bounds, amount)] += 1
        cells[-1] += amount

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative ``(le, count)`` pairs and the sum, from one copy of the cells."""
        cells = self.cells[:]
        total, buckets = 0.0, []
        for bound, count in zip((*self.bounds, float("inf")), cells[:-1], strict=True):
            total += count
            buckets.append((floatToGoString(bound), total))
        return buckets, cells[-1]


class LoopHistogram(Collector):
    """A histogram with prometheus-client's ``labels(...).observe(x)`` and ``observe(x)``,
    exposed under ``name`` with ``_bucket``, ``_count`` and ``_sum`` samples (no
    ``_created``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be distinct and ascending")
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.bounds = bounds
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if not self.labelnames:
            self._children[()] = HistogramChild(bounds)
        registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        """The child for these label values (created on first use)."""
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
            child = self._children[key] = HistogramChild(self.bounds)
        return child

    def observe(self, amount: float) -> None:
        """An observation of the unlabelled histogram."""
        child = self._children.get(())
        if child is None:
            raise ValueError(f"{self.name}: labelled by {self.labelnames}; use labels(...)")
        child.observe(amount)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self._children.items()):
            buckets, total = child.snapshot()
            family.add_metric(list(key), buckets, total)
        yield family
