"""The terms of a relayed reply: what an attempt is and how it is opened, the limits that
bound a reply (``RelayLimits``), what the relay counts across replies (``RelayCounts``), the
errors a reply ends with when no upstream took it or one stalled, and what each failure of
an attempt is called in the access log and the attempt counts.

This file only names things; deciding when an attempt failed and what happens next is
``upstream_relay``'s and ``upstream_attempts``'s. It must not know how an attempt is sent or
anything about HTTP.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from replystream.engine.base import EngineError, GenerationRequest, PushDeltaStream, RequestRejected
from replystream.engine.upstream_pool import Backend


class Attempt(PushDeltaStream, Protocol):
    """One attempt's stream as a relayed reply reads it: its deltas, when its upstream last
    streamed a reasoning model's thinking (progress, relayed or not: 0.0 for never), and
    whether it sent its finish reason (then ``end_at_finish`` ends the reply as whole);
    ``end_whole`` ends it as whole where the relay decided it is: at a stop string it saw
    complete, or at the request's token limit, which its upstream wrote past."""

    thought_at: float

    @property
    def finish_seen(self) -> bool: ...

    def end_at_finish(self) -> None: ...

    def end_whole(self) -> None: ...


# Sends ``request`` to ``backend`` and returns its stream once the response head arrived,
# awaiting that head no longer than the given seconds (the attempt's time to first content):
# raises ``FirstContentLate`` when those pass first, an ``EngineError`` for any other failure.
Opener = Callable[[Backend, GenerationRequest, float], Awaitable[Attempt]]


class FirstContentLate(Exception):
    """An ``Opener``'s: the attempt's time to its first content passed while its response
    head was awaited (before the head timeout did). That limit fired, not the head's: the
    relay counts and words it as ``ttft_timeout``, as when it passes after the head."""


# What an attempt's failure is counted and logged as (``base.ATTEMPT_RESULTS``), by its
# error's code: before a stream (else ``connect_error``), and in one (else ``stream_error``).
AT_HEAD = {
    "upstream_timeout": "head_timeout",
    "upstream_overloaded": "overloaded",
    "upstream_error_status": "error_status",
    "model_not_found": "model_not_found",
    "request_too_large": "too_large",
    "route_unsupported": "no_route",
}
IN_STREAM = {"upstream_ttft_timeout": "ttft_timeout", "upstream_stalled": "stalled"}
# Failures that say what the request asked of an upstream, not that the upstream is sick:
# another upstream may be tried, but its circuit does not count them (else requests for
# what it lacks would take it out of routing for every request).
NOT_ITS_HEALTH = frozenset(
    {
        "upstream_no_logprobs",
        "model_not_found",
        "request_too_large",
        "route_unsupported",
        "upstream_empty",
        "context_length_exceeded",  # said in the stream (``upstream_chunks``)
        "server_out_of_resources",  # ours: no file descriptor left for its connection
    }
)


class NoUpstream(EngineError):
    """No upstream serving the request can take it now (every circuit open, or none)."""

    status = 503


class ModelUnserved(RequestRejected):
    """No upstream serves the model a request would be sent as: each lists its models, and
    none lists that one (a 404, naming what they do list; no upstream is asked)."""

    status = 404


class RelayStalled(EngineError):
    """An upstream sent no content for too long (before or after the first token)."""

    status = 504


class RelayBroken(EngineError):
    """Relaying failed on our side (a bug): the reply ends with this, its upstream closed."""

    status = 502


class UpstreamBusy(EngineError):
    """Every upstream serving the request stayed at its limit of requests at once for as
    long as a request may wait for room (503)."""

    status = 503


@dataclass(frozen=True, slots=True)
class RelayLimits:
    ttft_s: float = 30.0  # per attempt: the first content within this
    stall_s: float = 60.0  # after it: no content for this long is a stall
    failover_s: float = 60.0  # from the request (or a seam) to giving up on other upstreams
    queue_s: float = 30.0  # the longest a request waits for room at upstreams at their limit

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.stall_s > 0 and self.failover_s > 0):
            raise ValueError("relay timeouts must be positive")
        if self.queue_s < 0:
            raise ValueError("the wait for room at an upstream cannot be negative")


@dataclass(slots=True)
class RelayCounts:
    """What the relay did across replies (read by the engine's ``stats``)."""

    failovers: int = 0
    spills: int = 0  # replies routed by prefix whose first upstream was not their key's own
    continuations: int = 0
    fallbacks: int = 0  # replies gone on to a fallback model (the routes file's)
    # Background requests that failed before relaying anything (their ``start`` did not wait
    # for an upstream to answer): counted with the requests whose ``start`` failed.
    unopened: int = 0
