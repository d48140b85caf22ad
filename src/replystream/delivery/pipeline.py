"""The reply pipeline: deltas in, numbered events out.

For one reply it applies hold-back moderation and stop strings (one withholding buffer,
``HoldBack``), batching and the wire dialect, and numbers the events (the ``id:`` a reader
resumes from). A stop string is decided here, not by the engine, so every engine gets it: the
reply ends at the first one (``halted``; the caller stops the engine), finishing ``"stop"``
with the matched string for dialects that name it. Log probabilities, when asked, go with
the tokens each event carries: the buffer and the batcher say how many tokens an event
holds, and that many are taken, in order, from the ones made (so text withheld or cut takes
its tokens' log probabilities with it). It is pure state: the caller passes the clock and
puts the returned ``LogEntry`` values into the reply log. It must not know about sockets,
tasks, stores or any transport's framing (a transport encodes each entry as it writes it).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from replystream.delivery.batching import Batcher
from replystream.delivery.formats import Spec, StreamFormat, Usage
from replystream.delivery.moderation import HoldBack, Violation
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogEntry
from replystream.delivery.tool_calls import ending_of
from replystream.engine.base import Delta, TokenLogprob


class Pipeline(Protocol):
    """What a reply's producer drives: ``ReplyPipeline``, or ``delivery.choices``'s for a
    reply with several choices."""

    next_seq: int
    halted: bool  # production must end: a check failed or a stop string completed
    batching: bool  # tokens may wait in a batch with a time window (see ``batch_due_at``)

    @property
    def violation(self) -> Violation | None: ...

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's size as the engine counted it (None: it did not say)."""
        ...

    @property
    def cached_prompt_tokens(self) -> int | None:
        """Of ``prompt_tokens``, those the engine found in its prefix cache (None: not said)."""
        ...

    @property
    def batch_due_at(self) -> float | None: ...

    def start(self, reply_id: str) -> list[LogEntry]: ...

    def admitted(self) -> list[LogEntry]: ...

    def push(self, delta: Delta, now: float) -> list[LogEntry]: ...

    def flush_due(self, now: float) -> list[LogEntry]: ...

    def finish(self) -> list[LogEntry]: ...

    def fail(self, message: str, code: str, status: int | None = None) -> list[LogEntry]: ...


class ReplyPipeline:
    """Turns one reply's deltas into log entries under a delivery policy."""

    # Every open reply holds one: slots instead of an instance dict (about 250 bytes less).
    __slots__ = (
        "_carried",
        "_direct",
        "batcher",
        "batching",
        "cached_prompt_tokens",
        "called",
        "ended",
        "finish_reason",
        "fmt",
        "halted",
        "holdback",
        "logprobs",
        "next_seq",
        "numbered",
        "prompt_estimate",
        "prompt_tokens",
        "reasoning_tokens",
        "tokens",
    )

    def __init__(
        self,
        fmt: StreamFormat,
        policy: DeliveryPolicy,
        *,
        numbered: bool = True,
        stops: tuple[str, ...] = (),
        logprobs: bool = False,
        prompt_estimate: int = 0,
    ) -> None:
        self.fmt = fmt
        self.numbered = numbered
        # The prompt's size as the server estimated it: the usage's, unless the engine counts
        # it (a relay says so only with its last delta, so not when a check ends the reply).
        self.prompt_estimate = prompt_estimate
        window_s = None if policy.batch_ms is None else policy.batch_ms / 1000.0
        # Every token its own event, nothing held: the common case skips both stages (and
        # does not even build them: thousands of open replies each carry this object).
        self._direct = (
            policy.holdback_tokens == 0
            and not policy.checks
            and not stops
            and not logprobs
            and (policy.batch_tokens is None or policy.batch_tokens == 1)
            and window_s is None
        )
        self.holdback = (
            None if self._direct else HoldBack(policy.holdback_tokens, policy.checks, stops)
        )
        self.batcher = None if self._direct else Batcher(policy.batch_tokens, window_s)
        self.batching = self.batcher is not None
        self.next_seq = 1
        self.tokens = 0
        # Tokens made with no text of their own (the end token; the first bytes of a
        # character the next token completes): no empty event is sent for them, as no
        # provider's API sends one; they are counted in the next text event.
        self._carried = 0
        self.reasoning_tokens = 0  # of ``tokens``: thinking relayed
        self.finish_reason = "stop"
        self.prompt_tokens: int | None = None  # the engine's own count, when it gave one
        self.cached_prompt_tokens: int | None = None  # of those, found in its prefix cache
        self.ended = False
        self.halted = False  # a check or a stop string ended the text: push no more deltas
        self.called = False  # the reply made a tool call
        # Log probabilities of tokens made and not yet in an event, oldest first (None: not asked).
        self.logprobs: deque[TokenLogprob] | None = deque() if logprobs else None

    def _entries(self, specs: list[Spec]) -> list[LogEntry]:
        seq = self.next_seq
        self.next_seq += len(specs)
        if len(specs) == 1:  # most often: one event per delta, without the comprehension
            event, data = specs[0]
            return [LogEntry(seq, event, data)]
        return [LogEntry(seq + index, event, data) for index, (event, data) in enumerate(specs)]

    def start(self, reply_id: str) -> list[LogEntry]:
        """The events that open a reply (its id, for a client that may need to resume)."""
        return self._entries(self.fmt.started(reply_id)) if self.numbered else []

    def admitted(self) -> list[LogEntry]:
        """The events that say the engine has taken the request up (once, after ``start``)."""
        return self._entries(self.fmt.admitted()) if self.numbered else []

    def push(self, delta: Delta, now: float) -> list[LogEntry]:
        """Events made ready by a new delta (none while text is held or batched)."""
        self.tokens += delta.tokens
        self.reasoning_tokens += delta.reasoning_tokens
        if delta.prompt_tokens is not None:  # on any delta: a stop string may end the reply
            self.prompt_tokens = delta.prompt_tokens  # before the engine's last one is read
            self.cached_prompt_tokens = delta.cached_prompt_tokens  # told with it, or not
            self.fmt.prompt_counted(delta.prompt_tokens, delta.cached_prompt_tokens)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        holdback, batcher = self.holdback, self.batcher
        if not delta.text:
            if delta.reasoning:
                # Thinking is not the answer: no check or stop string reads it (a server
                # with checks does not ask for it), and no text event holds it. The text
                # before it goes first, in order, as the whole reply has it: batched text,
                # and text held only for a window or a stop string's tail (a thought breaks
                # the text as a tool call does); text held for checks stays held (so no
                # tentative match is decided here: with no check, the text's end fails none).
                self.reasoning_tokens += delta.tokens
                releases = holdback is not None and not holdback.checks
                before = self._release_held() if releases else self._flush()
                return self._entries(before + self.fmt.reasoning(delta.reasoning, delta.tokens))
            if delta.tool_call is not None:
                # A call's pieces carry no text; log probabilities, if any came with one,
                # belong to no text event and are not queued for one.
                self.called = True
                if holdback is None or batcher is None:
                    return self._entries(self.fmt.tool_call(delta.tool_call))
                before = self._release_held()
                if holdback.violation is not None:  # a tentative match was final at the break
                    return self._end_moderated(before)  # and the call is never sent
                return self._entries(before + self.fmt.tool_call(delta.tool_call))
            if not delta.tokens:  # a finish, or a relay's continuation or refusal marker
                if delta.refusal:
                    # The text from here on is a refusal, which the dialect spells apart
                    # from an answer. It comes before any text, so nothing is held or
                    # batched before it; the refusal's words are text to every check. One
                    # after text or a call (a relay's continuation at an upstream that
                    # refuses) is not heeded: the answer's own words are no refusal, and
                    # the dialect has begun spelling them as text.
                    if self.tokens > self.reasoning_tokens or self.called:
                        return []
                    return self._entries(self.fmt.refusing())
                if delta.continued is not None:
                    # The text batched before the seam goes first, as the reply has it: the
                    # marker tells where the new upstream's text begins. (Text held for a
                    # check or a stop string's tail stays held: one may span the seam.)
                    before = self._flush()
                    return self._entries(before + self.fmt.continued(delta.continued, self.tokens))
                if holdback is None or batcher is None:
                    return []
            elif holdback is None or batcher is None:
                self._carried += delta.tokens
                return []
        if holdback is None or batcher is None:  # nothing held, nothing batched
            tokens = delta.tokens
            if self._carried:
                tokens += self._carried
                self._carried = 0
            return self._entries(self.fmt.text(delta.text, tokens))
        if self.logprobs is not None and delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        text, tokens = holdback.push(delta.text, delta.tokens)
        batch = batcher.add(text, tokens, now)
        specs = [] if batch is None else self._text(*batch)
        if holdback.ended:
            self.halted = True
            if holdback.violation is not None:
                return self._end_moderated(specs)
            self.finish_reason = "stop"  # even on the last token the length allowed
        return self._entries(specs)

    @property
    def violation(self) -> Violation | None:
        return None if self.holdback is None else self.holdback.violation

    @property
    def stop_sequence(self) -> str | None:
        """The stop string the reply ended at (None: it ended otherwise, or not yet)."""
        return None if self.holdback is None else self.holdback.stop_sequence

    @property
    def batch_due_at(self) -> float | None:
        """When the open batch's time window runs out (None: no batch open, or no window)."""
        return None if self.batcher is None else self.batcher.due_at

    def flush_due(self, now: float) -> list[LogEntry]:
        """The open batch, if its time window has run out."""
        if self.batcher is None or not self.batcher.expired(now):
            return []
        batch = self.batcher.flush()
        return [] if batch is None else self._entries(self._text(*batch))

    def _text(self, text: str, tokens: int) -> list[Spec]:
        """The events of released text, with its tokens' log probabilities when asked."""
        if not text:  # tokens with no text yet: counted (and their log probabilities sent)
            self._carried += tokens  # with the next text
            return []
        if self._carried:
            tokens += self._carried
            self._carried = 0
        made = self.logprobs
        if made is None:
            return self.fmt.text(text, tokens)
        taken = tuple(made.popleft() for _ in range(min(tokens, len(made))))
        holdback = self.holdback
        if holdback is not None and holdback.checks:
            taken = holdback.shown_alternatives(taken)
        return self.fmt.text_logprobs(text, tokens, taken)

    def _release_held(self) -> list[Spec]:
        """Text before a tool call: all of it goes out first, in order. The checks have
        seen it; the text it could still join with is gone (a tool call ends it), and the
        checks read text only, never a call's arguments. A tentative match is final at the
        break: then only the text before it goes out, and ``halted`` is set (the caller
        ends the reply moderated: ``_end_moderated``)."""
        assert self.holdback is not None and self.batcher is not None
        text, tokens = self.holdback.finish()
        if self.holdback.violation is not None:
            self.halted = True
        batch = self.batcher.add(text, tokens, 0.0)
        return ([] if batch is None else self._text(*batch)) + self._flush()

    def _flush(self) -> list[Spec]:
        batch = None if self.batcher is None else self.batcher.flush()
        return [] if batch is None else self._text(*batch)

    def flush(self) -> list[LogEntry]:
        """Whatever is batched, now (held text stays held)."""
        return self._entries(self._flush())

    def usage(self) -> Usage:
        """The tokens made so far (whether shown or not: held text and a stop string's count
        too), and the prompt's, the engine's own count if it gave one."""
        prompt = self.prompt_estimate if self.prompt_tokens is None else self.prompt_tokens
        cached = self.cached_prompt_tokens  # None with an estimate: told only with a count
        return Usage(prompt, self.tokens, self.reasoning_tokens, cached)

    def _end_moderated(self, released: list[Spec]) -> list[LogEntry]:
        """``released`` (the text before the match), what is batched, then the ``moderated``
        event: the reply ends as its check failed."""
        assert self.holdback is not None and self.holdback.violation is not None
        self.ended = True
        # The batched text is formatted before the ending: a dialect that keeps state (a
        # Responses message item, a Messages text block) closes what holds that text, and
        # numbers its events in the order they are written.
        released = released + self._flush()
        return self._entries(released + self.fmt.moderated(self.holdback.violation, self.usage()))

    def finish(self) -> list[LogEntry]:
        """The reply ended normally: release held text, flush, then the end marker. A
        tentative match is final at the end: then the text before it goes out, and the
        ``moderated`` event instead of the end marker (``violation`` says so)."""
        self.ended = True
        specs: list[Spec] = []
        if self.holdback is not None and self.batcher is not None:
            text, tokens = self.holdback.finish()
            batch = self.batcher.add(text, tokens, 0.0)
            specs = [] if batch is None else self._text(*batch)
            if self.holdback.violation is not None:
                self.halted = True
                return self._end_moderated(specs)
            specs += self._flush()
            if self._carried and self.logprobs:
                # Text-less tokens at the end that have log probabilities (the first bytes
                # of a character never completed): sent, not lost, in a text-less event.
                taken = tuple(self.logprobs)
                specs += self.fmt.text_logprobs("", self._carried, taken)
        finish, stop = ending_of(self.called, self.finish_reason, self.stop_sequence)
        return self._entries(specs + self.fmt.finished(finish, self.usage(), stop))

    def fail(self, message: str, code: str, status: int | None = None) -> list[LogEntry]:
        """The reply ended early: its text ends where it stopped, so what is still held goes
        out as at a normal end (held as it could begin a stop string, none can complete now;
        held for the checks, they read it as the text's end, and none of a match goes out),
        as a whole reply that failed shows it; then an in-band error."""
        self.ended = True
        specs: list[Spec] = []
        if self.holdback is not None and self.batcher is not None:
            batch = self.batcher.add(*self.holdback.finish(), 0.0)
            specs = [] if batch is None else self._text(*batch)
        return self._entries(specs + self._flush() + self.fmt.error(message, code, status))
