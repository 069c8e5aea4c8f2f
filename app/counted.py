"""A labelled histogram observed with a weight: the shape of Stoker's latency metrics
(``app.metrics`` declares them).

The requests of one batch share its compute times, so a batch of n requests is one
observation of weight n, not n calls: per-request Python is what bounds the engine process.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector


class CountedHistogram(Collector):
    """A labelled histogram whose ``observe`` takes a count: the requests of one batch share
    its compute times, so a batch of n requests is one observation of weight n, not n calls
    (per-request Python is what bounds the engine process). Exposed like a Prometheus
    histogram: ``_bucket``, ``_sum``, ``_count``."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = (*buckets, float("inf"))
        self._series: dict[tuple[str, ...], CountedSeries] = {}
        self._lock = threading.Lock()
        REGISTRY.register(self)

    def labels(self, *values: str) -> CountedSeries:
        with self._lock:
            series = self._series.get(values)
            if series is None:
                series = self._series[values] = CountedSeries(self.bounds)
            return series

    def remove(self, *values: str) -> None:
        """Drop one label set (a model version that was unloaded)."""
        with self._lock:
            self._series.pop(values, None)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        with self._lock:
            series = list(self._series.items())
        for values, one in series:
            counts, total = one.snapshot()
            cumulative, buckets = 0.0, []
            for bound, count in zip(self.bounds, counts, strict=True):
                cumulative += count
                buckets.append(
                    ("+Inf" if bound == float("inf") else repr(float(bound)), cumulative)
                )
            family.add_metric(list(values), buckets, total)
        yield family


class CountedSeries:
    """One label set of a ``CountedHistogram``."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        at = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[at] += times
            self._sum += value * times

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum

    def merge(self, counts: list[int], total: float) -> None:
        """Add another series' observations (``snapshot`` of one with the same bounds)."""
        if len(counts) != len(self._counts):
            raise ValueError(f"{len(counts)} buckets for a series of {len(self._counts)}")
        with self._lock:
            for i, count in enumerate(counts):
                self._counts[i] += int(count)
            self._sum += float(total)
