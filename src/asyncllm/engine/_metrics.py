"""Per-request latency metrics, aggregated into histograms the HTTP ``/metrics`` endpoint exposes.

The output processor stamps each request as its tokens reach the stream (what a client sees):
queue time (arrival to first scheduled), time to first token, inter-token latency and end-to-end
latency. Histograms are cumulative, Prometheus style, with fixed bucket bounds in seconds.
"""

from __future__ import annotations

import bisect
from collections import Counter

import msgspec

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class HistogramSnapshot(msgspec.Struct, frozen=True):
    """A histogram's state: ``counts[i]`` observations were <= ``buckets[i]`` (cumulative)."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


class Histogram:
    """A fixed-bucket histogram; ``observe`` is O(log buckets).

    Args:
        buckets: Increasing upper bounds; an implicit +Inf bucket follows.
    """

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Record ``value`` (``times`` times)."""
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self._counts):
            self._counts[index] += times
        self.count += times
        self.sum += value * times

    def snapshot(self) -> HistogramSnapshot:
        """The cumulative counts per bucket, count and sum."""
        cumulative, running = [], 0
        for count in self._counts:
            running += count
            cumulative.append(running)
        return HistogramSnapshot(self.buckets, tuple(cumulative), self.count, self.sum)


class EngineMetrics:
    """Every latency histogram and token counter of one engine."""

    def __init__(self) -> None:
        self.queue_time = Histogram()
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()
        self.e2e_latency = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_requests: Counter[str] = Counter()
        """Finished requests by finish reason."""
