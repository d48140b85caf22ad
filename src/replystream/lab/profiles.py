"""How one load run paces its requests: the profile (synchronous, concurrent, throughput,
constant, poisson).

This file decides the one mechanism every profile reduces to: a closed loop (a fixed number of
requests in flight, a finished one starts the next) or an open loop (requests issued at given
times from the start, whatever is still in flight). ``sweep`` is not a profile of one run but a
series of them (``sweep``); it must not appear here. Pure: no sockets, no clocks.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

ProfileKind = Literal["synchronous", "concurrent", "throughput", "constant", "poisson", "trace"]
PROFILE_KINDS: tuple[ProfileKind, ...] = (
    "synchronous",
    "concurrent",
    "throughput",
    "constant",
    "poisson",
)


@dataclass(frozen=True, slots=True)
class Profile:
    """The pacing of one run.

    - ``synchronous``: one request at a time (a closed loop of 1);
    - ``concurrent``: ``concurrency`` requests in flight (a closed loop);
    - ``throughput``: every request issued at once (an open loop with all arrivals at 0), so
      the server's own limits decide how fast they finish;
    - ``constant``: ``rate`` requests per second, evenly spaced (an open loop);
    - ``poisson``: ``rate`` per second with gamma gaps of shape ``burstiness`` (1: Poisson);
    - ``trace``: at the recorded ``times`` (seconds from the start, in order), then no more.
    """

    kind: ProfileKind
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    times: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind == "concurrent":
            if self.concurrency is None or self.concurrency < 1:
                raise ValueError("the concurrent profile needs a concurrency of at least 1")
        elif self.concurrency is not None:
            raise ValueError(f"the {self.kind} profile takes no concurrency")
        if self.kind in ("constant", "poisson"):
            if self.rate is None or not self.rate > 0:
                raise ValueError(f"the {self.kind} profile needs a positive rate")
        elif self.rate is not None:
            raise ValueError(f"the {self.kind} profile takes no rate")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be positive")
        if self.burstiness != 1.0 and self.kind != "poisson":
            raise ValueError("burstiness shapes the poisson profile's gaps only")
        if (self.kind == "trace") != bool(self.times):
            raise ValueError("the trace profile, and only it, replays recorded times")
        if any(b < a for a, b in itertools.pairwise(self.times)) or min(self.times, default=0) < 0:
            raise ValueError("a trace's times must be >= 0 and in order")

    @classmethod
    def synchronous(cls) -> Profile:
        return cls("synchronous")

    @property
    def in_flight(self) -> int | None:
        """Requests kept in flight by a closed loop; None for an open loop."""
        if self.kind == "synchronous":
            return 1
        return self.concurrency

    def arrivals(self, seed: int) -> Iterator[float]:
        """Seconds from the start at which each request of an open loop is issued, forever.

        Raises ValueError for a closed-loop profile, which has no arrival times.
        """
        if self.kind == "throughput":
            return itertools.repeat(0.0)
        if self.kind == "trace":
            return iter(self.times)
        if self.rate is None:
            raise ValueError(f"the {self.kind} profile is a closed loop: it has no arrivals")
        if self.kind == "constant":
            gap = 1.0 / self.rate
            return (i * gap for i in itertools.count())
        return arrival_offsets(self.rate, self.burstiness, seed)

    def describe(self) -> str:
        if self.kind == "synchronous":
            return "synchronous (closed loop, 1 in flight)"
        if self.kind == "concurrent":
            return f"concurrent (closed loop, {self.concurrency} in flight)"
        if self.kind == "throughput":
            return "throughput (every request at once)"
        if self.kind == "trace":
            return f"trace (open loop, {len(self.times)} recorded arrivals)"
        if self.kind == "constant":
            return f"constant (open loop, {self.rate:g} req/s evenly spaced)"
        return f"poisson (open loop, {self.rate:g} req/s, gamma k={self.burstiness:g})"


def arrival_offsets(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds from the start at which each request of a gamma-paced open loop arrives, forever.

    Gaps are gamma distributed with shape ``burstiness`` (k) and mean ``1 / rate``: k = 1 is a
    Poisson process, k < 1 burstier (clumps and lulls), k > 1 more regular.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    at = 0.0
    while True:
        yield at
        at += rng.gammavariate(burstiness, scale)
