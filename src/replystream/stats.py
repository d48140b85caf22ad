"""Summary statistics shared by the lab, the benchmarks and the load tools.

Percentiles use linear interpolation between closest ranks (NumPy's default ``linear``
method, the ``R-7`` estimator): p-th percentile of sorted x at rank (n - 1) * p / 100.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) of ``values`` by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError("p must be within 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


PERCENTILES = (50, 90, 95, 99)

# Upper bounds (seconds) of the latency histograms: time to first token, queueing, whole
# replies; the server's own and those a relay keeps of its upstreams.
LATENCY_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p95, p99, min, max (None when there are no values)."""
    out: dict[str, float | int | None] = {"count": len(values)}
    ordered = sorted(values)
    out["mean"] = sum(ordered) / len(ordered) if ordered else None
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ordered, p) if ordered else None
    out["min"] = ordered[0] if ordered else None
    out["max"] = ordered[-1] if ordered else None
    return out
