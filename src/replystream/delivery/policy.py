"""Delivery policy: how one reply travels from the engine to its reader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from replystream.delivery.moderation import Check

# The ranges of the four fields a request may set, whether a request or the command line sets
# them: far past any useful value, so a slip such as 1e300 (or a keep-alive every nanosecond,
# which would fill a socket with comments) is refused wherever it is given.
BATCH_TOKENS_MAX = 4096
HOLDBACK_TOKENS_MAX = 4096
BATCH_MS_MAX = 60_000.0
KEEPALIVE_S_MIN = 0.1
KEEPALIVE_S_MAX = 3600.0


@dataclass(frozen=True, slots=True)
class DeliveryPolicy:
    """Server defaults come from the command line; requests may override the first four.

    Attributes:
        batch_tokens: send an event once this many tokens are waiting (1: every token; None,
            not set: every token, or, with a window, as many as the window gathers).
        batch_ms: or once the oldest waiting token is this old (None: no time window).
        holdback_tokens: tokens kept back until checks have seen the text after them.
        keepalive_s: send a comment after this long without any other byte (None: never).
        slow_client_bytes: cut a stream when this much more text waits for its socket than
            the least it has had waiting (a resume starts with its backlog allowed).
        slow_client_s: cut a stream whose socket has not drained for this long.
        checks: moderation checks run on held-back text.
    """

    batch_tokens: int | None = None
    batch_ms: float | None = None
    holdback_tokens: int = 0
    keepalive_s: float | None = 15.0
    slow_client_bytes: int = 1 << 20
    slow_client_s: float = 30.0
    checks: Sequence[Check] = field(default=())

    def __post_init__(self) -> None:
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError("batch_tokens must be at least 1")
        if self.batch_ms is not None and self.batch_ms < 0:
            raise ValueError("batch_ms must be >= 0")
        if self.holdback_tokens < 0:
            raise ValueError("holdback_tokens must be >= 0")
        if self.keepalive_s is not None and self.keepalive_s <= 0:
            raise ValueError("keepalive_s must be > 0")
        if self.slow_client_bytes < 1 or self.slow_client_s <= 0:
            raise ValueError("slow-client limits must be positive")

    @property
    def shows_thinking(self) -> bool:
        """Whether a reasoning model's thinking may reach the client: not while checks run,
        since they read the answer's text alone and thinking would pass them unread."""
        return not self.checks

    def with_overrides(self, **changes: object) -> DeliveryPolicy:
        """A copy with the given fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]
