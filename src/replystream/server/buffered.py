"""Deliver one admitted generation as one JSON body, once the whole reply is made.

A pump task moves the engine's deltas into a ``DeltaChannel``; the handler collects them,
running the moderation checks over the whole text. A client that leaves cancels the handler,
which cancels the pump and closes the engine's stream in ``finally``. Endings: finished (200),
moderated (200, ``finish_reason: "moderated"``), failed (the error's status: 500, or 502
or 504 for an upstream), shutdown (503). It must not
know how tokens are made or which route asked for the reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from aiohttp import web

from replystream.delivery.channel import DeltaChannel, End, pump
from replystream.delivery.choices import moderated_reply
from replystream.delivery.formats import Usage
from replystream.delivery.moderation import Check, HoldBack, Violation
from replystream.delivery.reply_content import Thought, Thoughts
from replystream.delivery.sliced_json import dumps_sliced
from replystream.delivery.tool_calls import ToolCall, ToolCalls, ending_of
from replystream.engine.base import Delta, DeltaStream, TokenLogprob
from replystream.server.errors import error_response
from replystream.server.metrics import ReplyRecord
from replystream.server.replies import ReplyManager, close_quietly

log = logging.getLogger("replystream.buffered")

WHOLE_REPLY = 1 << 30  # a hold-back window longer than any reply


class Whole(NamedTuple):
    """A reply collected whole, as its body is made from it."""

    text: str
    finish_reason: str
    usage: Usage
    stop_sequence: str | None = None  # the stop string it ended at
    logprobs: tuple[TokenLogprob, ...] | None = None  # of the tokens of ``text``, when asked
    violation: Violation | None = None  # a check stopped it (``text``: what was released)
    tool_calls: tuple[ToolCall, ...] = ()  # joined from their pieces, in the order they started
    thoughts: tuple[Thought, ...] = ()  # a reasoning model's thinking, when it was asked for
    # With ``logprobs``: where each call or stretch of thinking began, as (characters of the
    # text before it, how many of ``logprobs`` are theirs), for a dialect that splits the
    # text there (a Responses output's message items).
    logprobs_at: tuple[tuple[int, int], ...] = ()
    refused: bool = False  # ``text`` is the model's refusal to answer (``Delta.refusal``)

    @property
    def reasoning(self) -> str:
        """All the thinking, joined (for the dialects that hold it in one field)."""
        return "".join(thought.text for thought in self.thoughts)


BodyFn = Callable[[Whole], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Several:
    """A buffered reply of ``n`` choices: the body of them all, and how to stop one."""

    n: int
    body: Callable[[list[Whole]], dict[str, Any]]
    close_choice: Callable[[int], None]


# A reply a check stopped: what was released of it (its text, and the calls, thinking and log
# probabilities that came with that text), and the check's violation.
ModeratedFn = Callable[[Whole, Violation], dict[str, Any]]
# A reply that failed after it was admitted, for a dialect whose failed reply is an object of
# its own (a Responses ``status: failed``): from what was made before the failure (usage not
# known), the error's code and its message.
FailedFn = Callable[[Whole, str, str], dict[str, Any]]


class _Collector:
    """One choice collected whole: its text held (and checked) to the end."""

    def __init__(self, checks: Sequence[Check], stops: tuple[str, ...], logprobs: bool) -> None:
        # Nothing leaves before the end, so every token stays held: a phrase whose start came
        # tokens before its end is cut from its start, as a stream's window would if it were
        # long. Stop strings are cut as in a stream (the same ``HoldBack``).
        self.holdback = HoldBack(WHOLE_REPLY, checks, stops)
        self.parts: list[str] = []
        self.made: list[TokenLogprob] | None = [] if logprobs else None
        self.made_at: dict[int, int] = {}  # text characters -> ``made`` so far, at each break
        self.calls = ToolCalls()
        self.thoughts = Thoughts()  # never checked, cut or counted as text
        self.text_chars = 0  # of the text so far, where a stretch of thinking begins
        self.reasoning_tokens = 0
        self.finish_reason = "stop"
        self.tokens = 0
        self.refused = False  # the text is a refusal (``Delta.refusal``)
        self.done = False  # a check failed or a stop string completed: take no more

    def take(self, delta: Delta) -> bool:
        """Add a delta; True once this choice needs no more (its generation can stop)."""
        self.tokens += delta.tokens
        self.reasoning_tokens += delta.reasoning_tokens
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
        if delta.refusal:  # a marker, before any text: the text is checked all the same
            # (One after text or a call, as a stream does not heed it: see ``ReplyPipeline``.)
            if self.tokens == self.reasoning_tokens and not self.calls.calls:
                self.refused = True
            return False
        if delta.reasoning:
            # As in a stream: the text before it is let out (with no check, so its end
            # fails nothing); text held for checks stays held.
            if not self.holdback.checks:
                self.parts.append(self.holdback.finish()[0])
            self.thoughts.add(delta.reasoning, self.text_chars, len(self.calls.calls))
            self._break_at(self.text_chars)
            self.reasoning_tokens += delta.tokens
            return False
        if delta.text or delta.tool_call is not None:
            self.thoughts.interrupt()
        if delta.tool_call is not None:
            # As in a stream: a call ends the text before it (held text is released, and no
            # stop string spans it); its pieces are no text and have no log probabilities.
            # A tentative match is final there: the reply ends before the call.
            self.parts.append(self.holdback.finish()[0])
            if self.holdback.violation is not None:
                self.done = True
                return True
            self.calls.add(delta.tool_call, self.holdback.released_chars)
            self._break_at(self.holdback.released_chars)
            return False
        if self.made is not None and delta.logprobs:
            self.made.extend(delta.logprobs)
        self.text_chars += len(delta.text)
        self.parts.append(self.holdback.push(delta.text, delta.tokens)[0])
        self.done = self.holdback.ended
        return self.done

    def _break_at(self, chars: int) -> None:
        if self.made is not None:
            self.made_at[chars] = len(self.made)

    def end_text(self) -> None:
        """The text ended: release what is still held. A tentative match is final now, and
        may stop the text (``holdback.violation``)."""
        if not self.holdback.ended:
            self.parts.append(self.holdback.finish()[0])

    def whole(self, usage: Usage) -> Whole:
        holdback = self.holdback
        self.end_text()
        stop = holdback.stop_sequence
        finish = "stop" if stop is not None else self.finish_reason
        finish, stop = ending_of(bool(self.calls.calls), finish, stop)
        # The tokens of the text released (not those of a stop string cut from it).
        shown = None
        if self.made is not None:
            shown = tuple(self.made[: holdback.released_tokens])
            if holdback.checks:
                shown = holdback.shown_alternatives(shown)
        text = "".join(self.parts)
        usage = replace(usage, reasoning_tokens=self.reasoning_tokens)
        calls, thoughts = self.calls.whole(), self.thoughts.whole()
        breaks = tuple(self.made_at.items())
        return Whole(
            text,
            finish,
            usage,
            stop,
            shown,
            holdback.violation,
            calls,
            thoughts,
            breaks,
            self.refused,
        )


async def buffered_reply(
    deltas: DeltaStream,
    *,
    manager: ReplyManager,
    record: ReplyRecord,
    checks: Sequence[Check],
    stops: tuple[str, ...],
    logprobs: bool,
    prompt_tokens: int,
    body: BodyFn,
    moderated_body: ModeratedFn,
    named: str,
    shape_error: Callable[[web.Response], web.Response],
    several: Several | None = None,
    failed_body: FailedFn | None = None,
) -> web.Response:
    """Collect an admitted generation whole and answer once, as JSON.

    ``body(whole)`` shapes a finished reply; ``moderated_body(whole, violation)`` a reply a
    check stopped (its text what was released, with the calls and thinking that came before
    the match; its usage counts the tokens made up to the match, as a stream's does). A
    failure is a 500, a shutdown a 503; or, given ``failed_body``, a 200 with that body, as
    a dialect whose stored replies end so answers them (its code: ``shutdown`` for a
    shutdown). The generation is stopped at the first stop string. ``several``: ``deltas``
    are several choices' (``Delta.choice``), each collected on its own, and the body is
    ``several.body`` of them all. Tool calls are joined from their pieces, in the order they
    started (``Whole.tool_calls``). ``named``: which reply the log says failed ("reply
    <id>", or "request <id>" for one with no id). ``shape_error``: an error response in the
    shape its route's clients read (``errors.in_route_shape``), made here so that the body
    counted as sent is the one they read.
    """
    channel = DeltaChannel()
    collectors = [
        _Collector(checks, stops, logprobs) for _ in range(1 if several is None else several.n)
    ]
    open_choices = len(collectors)
    cached: int | None = None  # of the engine's count of the prompt, its prefix cache's
    # The choice whose count is taken: the first (lowest index) that gave one, as a stream's
    # usage takes it; a later choice's may find the prompt its siblings just cached.
    counted_by: int | None = None

    def usage(tokens: int) -> Usage:
        return Usage(prompt_tokens, tokens, cached_prompt_tokens=cached)

    item: Delta | End | object = None
    manager.track(channel)
    try:
        async with asyncio.TaskGroup() as group:
            pump_task = group.create_task(pump(deltas, channel))
            try:
                while True:
                    item = await channel.get()
                    if isinstance(item, End):
                        break
                    assert isinstance(item, Delta)
                    record.on_delta(item.made_at, item.tokens, item.choice)
                    if item.prompt_tokens is not None and (  # the engine's own count
                        counted_by is None or item.choice < counted_by
                    ):
                        prompt_tokens = item.prompt_tokens
                        cached = item.cached_prompt_tokens
                        counted_by = item.choice
                    collector = collectors[item.choice]
                    if collector.done or not collector.take(item):
                        continue
                    open_choices -= 1  # a check failed, or a stop string completed
                    if several is None or not open_choices:
                        break
                    several.close_choice(item.choice)
            finally:
                pump_task.cancel()
        first = collectors[0]
        if several is None and not (isinstance(item, End) and item.how != "finished"):
            first.end_text()  # before its violation is read: the text's end may decide one
        if several is None and first.holdback.violation is not None:
            record.outcome, record.reason = "moderated", first.holdback.violation.check
            made = first.whole(usage(first.tokens))
            payload = moderated_body(made, first.holdback.violation)
        elif isinstance(item, End) and item.how == "failed":
            assert item.error is not None
            log.warning("%s: generation failed: %s", named, item.error)
            record.outcome, record.reason = "errored", item.error.code
            error = item.error
            if failed_body is not None and several is None:
                made = first.whole(usage(record.tokens))
                payload = failed_body(made, error.code, str(error))
            else:
                # An upstream's failure is a 502, 503 or 504, as it would be before any byte.
                failure = error_response(
                    error.status,
                    str(error),
                    code=error.code,
                    retry_after_s=error.retry_after_s,
                    lasting=error.lasting,
                )
                return shape_error(failure)
        elif isinstance(item, End) and item.how == "shutdown":
            record.outcome, record.reason = "shutdown", "shutdown"
            message = "the server is shutting down"
            if failed_body is None or several is not None:
                return shape_error(error_response(503, message, code="shutdown"))
            made = first.whole(usage(record.tokens))
            payload = failed_body(made, "shutdown", message)
        elif several is None:
            record.outcome = "finished"
            payload = body(first.whole(usage(record.tokens)))
        else:
            wholes = [c.whole(usage(c.tokens)) for c in collectors]
            record.outcome = "finished"
            violation = moderated_reply(whole.violation for whole in wholes)
            if violation is not None:
                record.outcome, record.reason = "moderated", violation.check
            payload = several.body(wholes)
        return await json_response(payload)
    except asyncio.CancelledError:
        record.outcome, record.reason = "cancelled", "client_gone"
        raise
    finally:
        record.prompt_tokens, record.cached_prompt_tokens = prompt_tokens, cached or 0
        await close_quietly(deltas)
        manager.untrack(channel)
        manager.metrics.observe(record)


async def json_response(payload: dict[str, Any]) -> web.Response:
    """A compact JSON body (no spaces after separators, as the lab's byte counts assume), its
    large lists written in slices (``dumps_sliced``)."""
    body = await dumps_sliced(payload)
    return web.Response(body=body, content_type="application/json", charset="utf-8")
