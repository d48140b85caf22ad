"""The pipeline of a reply with several choices (``n > 1``): one ``ReplyPipeline`` per choice,
one numbering, one ending.

Each choice's deltas (``Delta.choice``) go through that choice's own pipeline (its hold-back
buffer, stop strings, batching and log probabilities) in its own format (the dialect's chunks
with that choice's ``index``); the events are renumbered into the reply's one sequence, so the
choices are interleaved in the log in the order their tokens were made, and the reply is
resumable like any other. A choice finishes on its own: when its generation says so, when a
stop string completes (then ``on_choice_done`` is told, to stop its generation) or when a
check stops its text; its finish event leaves at once. The reply's own ending (usage summed
over the choices, the end marker) comes once every choice is done. This file is pure state:
no clock, no I/O, nothing of sockets or stores. A reply with one choice never uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from replystream.delivery.formats import Spec, StreamFormat, Usage
from replystream.delivery.moderation import Violation
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogEntry
from replystream.engine.base import Delta


def moderated_reply(stopped: Iterable[Violation | None]) -> Violation | None:
    """Of a reply's choices' checks (None: that choice was not stopped by one), the first
    choice's when a check stopped every choice: the reply was moderated; else None (one
    choice that finished makes a reply that finished). Streamed or whole, the same rule."""
    found = list(stopped)
    return found[0] if found and all(v is not None for v in found) else None


class ChoicesPipeline:
    """Turns the merged deltas of several choices into one reply's log entries."""

    def __init__(
        self,
        formats: Sequence[StreamFormat],
        ending: Callable[[Usage], list[Spec]],
        policy: DeliveryPolicy,
        *,
        stops: tuple[str, ...] = (),
        logprobs: bool = False,
        on_choice_done: Callable[[int], None] = lambda _index: None,
        prompt_estimate: int = 0,
    ) -> None:
        if len(formats) < 2:
            raise ValueError("a reply with several choices needs at least two formats")
        self.choices = [
            ReplyPipeline(fmt, policy, stops=stops, logprobs=logprobs) for fmt in formats
        ]
        self._ending = ending
        self.prompt_estimate = prompt_estimate  # the usage's, unless an engine counts it
        self.batching = any(choice.batching for choice in self.choices)
        self._on_choice_done = on_choice_done
        self._done = [False] * len(formats)
        self.next_seq = 1
        self.ended = False
        # A check or a stop string ends one choice, never the reply: production goes on.
        self.halted = False

    @property
    def violation(self) -> Violation | None:
        """The first choice's check, once a check has stopped every choice's text: the
        reply was moderated (one choice that finished makes a reply that finished)."""
        return moderated_reply(choice.violation for choice in self.choices)

    @property
    def tokens(self) -> int:
        return sum(choice.tokens for choice in self.choices)

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's size as an engine counted it, if one did: every choice's generation
        read the same prompt, and usage counts it once (as OpenAI's does for ``n``)."""
        return next((c.prompt_tokens for c in self.choices if c.prompt_tokens is not None), None)

    @property
    def cached_prompt_tokens(self) -> int | None:
        """Of ``prompt_tokens``, those the same choice's count found in its prefix cache (a
        relay's choices are several upstream requests: the pair comes from one of them)."""
        counted = (c for c in self.choices if c.prompt_tokens is not None)
        return next((c.cached_prompt_tokens for c in counted), None)

    def _number(self, entries: list[LogEntry]) -> list[LogEntry]:
        seq = self.next_seq
        self.next_seq += len(entries)
        return [LogEntry(seq + i, e.event, e.data) for i, e in enumerate(entries)]

    def start(self, reply_id: str) -> list[LogEntry]:
        """Every choice's opening events (the first one names the reply)."""
        return self._number([e for choice in self.choices for e in choice.start(reply_id)])

    def admitted(self) -> list[LogEntry]:
        """Every choice's events that say the engine took the request up."""
        return self._number([e for choice in self.choices for e in choice.admitted()])

    def push(self, delta: Delta, now: float) -> list[LogEntry]:
        """Events made ready by a delta of one choice (its finish, if it finished)."""
        index = delta.choice
        if self._done[index]:
            return []  # made before its generation was stopped: never shown
        choice = self.choices[index]
        entries = choice.push(delta, now)
        if choice.ended:  # a check stopped its text: its moderated ending is in ``entries``
            self._done[index] = True
            self._on_choice_done(index)
        elif choice.halted or delta.finish_reason is not None:
            entries += self._finish_choice(index)
        return self._number(entries)

    def _finish_choice(self, index: int) -> list[LogEntry]:
        self._done[index] = True
        if self.choices[index].halted:
            self._on_choice_done(index)  # a stop string: its generation is stopped now
        # Its format leaves the usage to the reply's end. The end of its text may make a
        # match final (one that reached the end of the text so far): then it ends moderated.
        return self.choices[index].finish()

    @property
    def batch_due_at(self) -> float | None:
        due = [c.batch_due_at for c in self.choices if c.batch_due_at is not None]
        return min(due, default=None)

    def flush_due(self, now: float) -> list[LogEntry]:
        return self._number([e for choice in self.choices for e in choice.flush_due(now)])

    def finish(self) -> list[LogEntry]:
        """Every generation ended: the choices still open finish, then the reply's ending."""
        self.ended = True
        entries = [
            e
            for index in range(len(self.choices))
            if not self._done[index]
            for e in self._finish_choice(index)
        ]
        reported = self.prompt_tokens
        thought = sum(choice.reasoning_tokens for choice in self.choices)
        prompt = self.prompt_estimate if reported is None else reported
        usage = Usage(prompt, self.tokens, thought, self.cached_prompt_tokens)
        return self._number(entries) + self._number(
            [LogEntry(0, event, data) for event, data in self._ending(usage)]
        )

    def fail(self, message: str, code: str, status: int | None = None) -> list[LogEntry]:
        """The reply ended early: text released so far goes out, then one in-band error."""
        self.ended = True
        flushed = [e for choice in self.choices for e in choice.flush()]
        error = self.choices[0].fmt.error(message, code, status)
        return self._number(flushed + [LogEntry(0, event, data) for event, data in error])
