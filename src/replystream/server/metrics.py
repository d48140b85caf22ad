"""Prometheus metrics for replies, fed once per reply so the per-event path stays free of them.

Each reply keeps its own plain counters and timestamps in a ``ReplyRecord`` while it streams;
when it ends, ``Metrics.observe`` moves them into the registry in one go.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


@dataclass(slots=True)
class ReplyRecord:
    """What one reply did, in ``time.monotonic()`` seconds; owned by its handler alone."""

    endpoint: str
    streamed: bool
    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    events: int = 0
    bytes_sent: int = 0
    outcome: Outcome = "cancelled"  # until proven otherwise: an exit we did not see is a cancel
    reason: str = ""

    def on_delta(self, made_at: float, tokens: int) -> None:
        self.token_times.append(made_at)
        self.tokens += tokens

    def on_send(self, nbytes: int, events: int = 1) -> None:
        self.bytes_sent += nbytes
        self.events += events


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
        self.itl = Histogram(
            "replystream_time_between_tokens_seconds",
            "Server time between consecutive tokens of a reply.",
            ["endpoint"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
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

    def observe(self, record: ReplyRecord) -> None:
        """Account for one reply that has ended."""
        endpoint = record.endpoint
        ended = time.monotonic()
        self.replies.labels(endpoint, record.outcome).inc()
        self.e2e.labels(endpoint).observe(ended - record.arrived_at)
        if record.admitted_at is not None:
            self.queue.labels(endpoint).observe(record.admitted_at - record.arrived_at)
        times = record.token_times
        if times:
            self.ttft.labels(endpoint).observe(times[0] - record.arrived_at)
            itl = self.itl.labels(endpoint)
            for before, after in itertools.pairwise(times):
                itl.observe(after - before)
            if record.tokens > 1:
                self.tpot.labels(endpoint).observe((times[-1] - times[0]) / (record.tokens - 1))
        if record.events:
            self.events.labels(endpoint).inc(record.events)
        if record.bytes_sent:
            self.bytes.labels(endpoint).inc(record.bytes_sent)
        if record.tokens:
            self.tokens.labels(endpoint).inc(record.tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
