"""A bounded latency histogram: log-spaced buckets, constant memory, approximate percentiles."""

from __future__ import annotations

import bisect
import math
from typing import Optional


class LatencyHistogram:
    """Counts samples (seconds) in log-spaced buckets from ``low`` to ``high``.

    Memory is fixed (``buckets_per_decade`` x decades counters) however many samples arrive.
    ``percentile(q)`` returns the geometric middle of the bucket holding the q-th sample, so
    its relative error is at most half a bucket (about 6% with 20 buckets per decade).
    Samples below ``low`` count in the first bucket, above ``high`` in the last.
    """

    def __init__(self, low: float = 1e-4, high: float = 1e3, buckets_per_decade: int = 20):
        decades = math.log10(high / low)
        n = int(math.ceil(decades * buckets_per_decade))
        self._edges = [low * 10 ** (i / buckets_per_decade) for i in range(n + 1)]
        self._counts = [0] * (n + 2)  # [below low, n buckets, above high]
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self._counts[bisect.bisect_right(self._edges, seconds)] += 1
        self.count += 1
        self.total += seconds

    def mean(self) -> Optional[float]:
        return self.total / self.count if self.count else None

    def percentile(self, q: float) -> Optional[float]:
        """The q-th percentile (0 < q <= 100), or None without samples."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q / 100 * self.count))
        seen = 0
        for i, c in enumerate(self._counts):
            seen += c
            if seen >= rank:
                break
        lo = self._edges[max(i - 1, 0)]
        hi = self._edges[min(i, len(self._edges) - 1)]
        return math.sqrt(lo * hi)
