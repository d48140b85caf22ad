"""Prometheus metrics for replies, kept off the per-event path.

Each reply keeps plain counters and timestamps in a ``ReplyRecord`` while it streams; when it
ends, ``Metrics.observe`` moves them into the registry in one go. The one per-token metric,
time between tokens, goes into ``GapHistogram``: a bisect and an add, no lock, no per-reply
list, exported through a collector.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

Outcome = Literal[
    "finished", "cancelled", "errored", "moderated", "slow_client", "shutdown", "rejected"
]
OUTCOMES: tuple[Outcome, ...] = (
    "finished",
    "cancelled",
    "errored",
    "moderated",
    "slow_client",
    "shutdown",
    "rejected",
)

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class GapHistogram:
    """Time between tokens, for every reply: a histogram fed per token at the cost of one
    bisect and one add, with no per-reply storage (exported by ``Metrics``' collector)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, endpoint: str, value: float) -> None:
        counts = self.counts.get(endpoint)
        if counts is None:
            counts = self.counts[endpoint] = [0] * (len(self.bounds) + 1)
            self.sums[endpoint] = 0.0
        counts[bisect_left(self.bounds, value)] += 1
        self.sums[endpoint] += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "replystream_time_between_tokens_seconds",
            "Server time between consecutive tokens of a reply.",
            labels=["endpoint"],
        )
        for endpoint, counts in self.counts.items():
            cumulative, total = [], 0
            for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
                total += count
                cumulative.append(("+Inf" if bound == math.inf else repr(bound), total))
            family.add_metric([endpoint], cumulative, self.sums[endpoint])
        yield family


@dataclass(slots=True)
class ReplyRecord:
    """What one reply did, in ``time.monotonic()`` seconds; owned by its producer alone."""

    endpoint: str
    streamed: bool
    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: GapHistogram | None = None  # where time between tokens goes, as it happens
    tokens: int = 0
    events: int = 0
    bytes_sent: int = 0
    outcome: Outcome = "cancelled"  # until proven otherwise: an exit we did not see is a cancel
    reason: str = ""

    def on_delta(self, made_at: float, tokens: int) -> None:
        if self.last_token_at is None:
            self.first_token_at = made_at
        elif self.gaps is not None:
            self.gaps.observe(self.endpoint, made_at - self.last_token_at)
        self.last_token_at = made_at
        self.tokens += tokens

    def on_send(self, nbytes: int, events: int = 1) -> None:
        self.bytes_sent += nbytes
        self.events += events


class _Children(NamedTuple):
    """The labelled series of one endpoint (replies also by outcome, filled as seen)."""

    replies: dict[str, Counter]
    e2e: Histogram
    queue: Histogram
    ttft: Histogram
    tpot: Histogram
    events: Counter
    bytes: Counter
    tokens: Counter


class Metrics:
    """The server's metric families, in a registry of its own (one per application)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "replystream_time_to_first_token_seconds",
            "Server time from request arrival to the first token made.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.gaps = GapHistogram(_TOKEN_BUCKETS)
        r.register(self.gaps)
        self.tpot = Histogram(
            "replystream_time_per_output_token_seconds",
            "Per reply: (last token - first token) / (tokens - 1).",
            ["endpoint"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "replystream_queue_seconds",
            "Server time from request arrival until the engine admitted it.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "replystream_end_to_end_seconds",
            "Server time from request arrival until the reply ended, however it ended.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.active = Gauge(
            "replystream_active_streams", "Streamed replies open right now.", registry=r
        )
        self.replies = Counter(
            "replystream_replies",
            "Replies by how they ended.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.events = Counter(
            "replystream_events_sent", "Events written to clients.", ["endpoint"], registry=r
        )
        self.bytes = Counter(
            "replystream_bytes_sent", "Body bytes written to clients.", ["endpoint"], registry=r
        )
        self.tokens = Counter(
            "replystream_tokens_generated", "Tokens the engine made.", ["endpoint"], registry=r
        )
        self._states: dict[str, Gauge] = {}
        self._children: dict[str, _Children] = {}

    def state(
        self, name: str, documentation: str, read: Callable[[], float], **labels: str
    ) -> None:
        """A gauge read from ``read`` when scraped: what the process holds right now (tasks,
        files, KV blocks, reply logs), never updated per event."""
        gauge = self._states.get(name)
        if gauge is None:
            gauge = self._states[name] = Gauge(
                name, documentation, sorted(labels), registry=self.registry
            )
        (gauge.labels(**labels) if labels else gauge).set_function(read)

    def record(self, endpoint: str, *, streamed: bool) -> ReplyRecord:
        """A new reply's record, wired to the per-token histogram."""
        return ReplyRecord(endpoint, streamed, gaps=self.gaps)

    def observe(self, record: ReplyRecord) -> None:
        """Account for one reply that has ended."""
        endpoint = record.endpoint
        ended = time.monotonic()
        children = self._children.get(endpoint) or self._label(endpoint)
        outcome = children.replies.get(record.outcome)
        if outcome is None:
            outcome = children.replies[record.outcome] = self.replies.labels(
                endpoint, record.outcome
            )
        outcome.inc()
        children.e2e.observe(ended - record.arrived_at)
        if record.admitted_at is not None:
            children.queue.observe(record.admitted_at - record.arrived_at)
        first, last = record.first_token_at, record.last_token_at
        if first is not None and last is not None:
            children.ttft.observe(first - record.arrived_at)
            if record.tokens > 1:
                children.tpot.observe((last - first) / (record.tokens - 1))
        if record.events:
            children.events.inc(record.events)
        if record.bytes_sent:
            children.bytes.inc(record.bytes_sent)
        if record.tokens:
            children.tokens.inc(record.tokens)

    def _label(self, endpoint: str) -> _Children:
        """One endpoint's labelled series, looked up once (``labels()`` costs per call)."""
        children = self._children[endpoint] = _Children(
            replies={},
            e2e=self.e2e.labels(endpoint),
            queue=self.queue.labels(endpoint),
            ttft=self.ttft.labels(endpoint),
            tpot=self.tpot.labels(endpoint),
            events=self.events.labels(endpoint),
            bytes=self.bytes.labels(endpoint),
            tokens=self.tokens.labels(endpoint),
        )
        return children

    def render(self) -> bytes:
        return generate_latest(self.registry)
