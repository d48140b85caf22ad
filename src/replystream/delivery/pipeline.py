"""The reply pipeline: deltas in, numbered and encoded events out.

For one reply it applies hold-back moderation, batching and the wire dialect, and numbers the
events (the ``id:`` a reader resumes from). It is pure state: the caller passes the clock and
puts the returned ``LogEntry`` values into the reply log. It must not know about sockets,
tasks or stores.
"""

from __future__ import annotations

from replystream.delivery.batching import Batcher
from replystream.delivery.formats import Spec, StreamFormat, Usage
from replystream.delivery.moderation import HoldBack, Violation
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogEntry
from replystream.engine.base import Delta
from replystream.sse import encode_data

_NO_HOLDBACK = HoldBack(0, ())  # shared, stateless while nothing is pushed through it
_NO_BATCHER = Batcher(1)


class ReplyPipeline:
    """Turns one reply's deltas into log entries under a delivery policy."""

    # Every open reply holds one: slots instead of an instance dict (about 250 bytes less).
    __slots__ = (
        "_direct",
        "batcher",
        "ended",
        "finish_reason",
        "fmt",
        "holdback",
        "next_seq",
        "numbered",
        "tokens",
    )

    def __init__(self, fmt: StreamFormat, policy: DeliveryPolicy, *, numbered: bool = True) -> None:
        self.fmt = fmt
        self.numbered = numbered
        window_s = None if policy.batch_ms is None else policy.batch_ms / 1000.0
        # Every token its own event, nothing held: the common case skips both stages (and
        # does not even build them: thousands of open replies each carry this object).
        self._direct = (
            policy.holdback_tokens == 0
            and not policy.checks
            and policy.batch_tokens == 1
            and window_s is None
        )
        self.holdback = (
            HoldBack(policy.holdback_tokens, policy.checks) if not self._direct else _NO_HOLDBACK
        )
        self.batcher = Batcher(policy.batch_tokens, window_s) if not self._direct else _NO_BATCHER
        self.next_seq = 1
        self.tokens = 0
        self.finish_reason = "stop"
        self.ended = False

    def _entries(self, specs: list[Spec]) -> list[LogEntry]:
        out = []
        for event_type, data in specs:
            seq = self.next_seq
            self.next_seq += 1
            if self.numbered and event_type and "\n" not in data and "\r" not in data:
                # The common one-line event, written directly (what encode_data would write).
                frame = f"event: {event_type}\nid: {seq}\ndata: {data}\n\n".encode()
            else:
                event_id = str(seq) if self.numbered else None
                frame = encode_data(data, type=event_type, id=event_id)
            out.append(LogEntry(seq, frame))
        return out

    def start(self, reply_id: str) -> list[LogEntry]:
        """The events that open a reply (its id, for a client that may need to resume)."""
        return self._entries(self.fmt.started(reply_id)) if self.numbered else []

    def push(self, delta: Delta, now: float) -> list[LogEntry]:
        """Events made ready by a new delta (none while text is held or batched)."""
        self.tokens += delta.tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        if self._direct:
            if not delta.text and not delta.tokens:
                return []
            return self._entries([self.fmt.text(delta.text, delta.tokens)])
        text, tokens = self.holdback.push(delta.text, delta.tokens)
        batch = self.batcher.add(text, tokens, now)
        specs = [] if batch is None else [self.fmt.text(*batch)]
        if self.holdback.violation is not None:
            return self._entries(specs) + self._end_moderated(self.holdback.violation)
        return self._entries(specs)

    @property
    def violation(self) -> Violation | None:
        return self.holdback.violation

    def flush_due(self, now: float) -> list[LogEntry]:
        """The open batch, if its time window has run out."""
        if not self.batcher.expired(now):
            return []
        batch = self.batcher.flush()
        return [] if batch is None else self._entries([self.fmt.text(*batch)])

    def _flush(self) -> list[Spec]:
        batch = self.batcher.flush()
        return [] if batch is None else [self.fmt.text(*batch)]

    def _end_moderated(self, violation: Violation) -> list[LogEntry]:
        self.ended = True
        return self._entries(self._flush() + self.fmt.moderated(violation))

    def finish(self, prompt_tokens: int) -> list[LogEntry]:
        """The reply ended normally: release held text, flush, then the end marker."""
        self.ended = True
        text, tokens = self.holdback.finish()
        batch = self.batcher.add(text, tokens, 0.0)
        specs = [] if batch is None else [self.fmt.text(*batch)]
        specs += self._flush()
        return self._entries(
            specs + self.fmt.finished(self.finish_reason, Usage(prompt_tokens, self.tokens))
        )

    def fail(self, message: str, code: str) -> list[LogEntry]:
        """The reply ended early: released text goes out, then an in-band error."""
        self.ended = True
        return self._entries(self._flush() + self.fmt.error(message, code))
