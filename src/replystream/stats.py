"""Summary statistics shared by the lab, the benchmarks and the load tools.

Percentiles use linear interpolation between closest ranks (NumPy's default ``linear``
method, the ``R-7`` estimator): p-th percentile of sorted x at rank (n - 1) * p / 100.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


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


def summarize(values: Iterable[float], points: Sequence[float] = (50, 95)) -> dict[str, float]:
    """``median`` (as p50), the requested percentiles, ``mean``, ``min`` and ``max``."""
    data = sorted(values)
    if not data:
        return {"count": 0}
    out: dict[str, float] = {"count": len(data), "median": percentile(data, 50)}
    for p in points:
        out[f"p{p:g}"] = percentile(data, p)
    out["mean"] = sum(data) / len(data)
    out["min"] = data[0]
    out["max"] = data[-1]
    return out
