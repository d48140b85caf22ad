"""Deliver one admitted generation as one JSON body, once the whole reply is made.

A pump task moves the engine's deltas into a ``DeltaChannel``; the handler collects them,
running the moderation checks over the whole text. A client that leaves cancels the handler,
which cancels the pump and closes the engine's stream in ``finally``. Endings: finished (200),
moderated (200, ``finish_reason: "moderated"``), failed (500), shutdown (503). It must not
know how tokens are made or which route asked for the reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from aiohttp import web

from replystream.delivery.channel import DeltaChannel, End, pump
from replystream.delivery.formats import Usage
from replystream.delivery.moderation import Check, HoldBack, Violation
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


BodyFn = Callable[[Whole], dict[str, Any]]
ModeratedFn = Callable[[str, Violation], dict[str, Any]]


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
) -> web.Response:
    """Collect an admitted generation whole and answer once, as JSON.

    ``body(whole)`` shapes a finished reply; ``moderated_body(released text, violation)`` a
    reply a check stopped. A failure is a 500, a shutdown a 503. Stop strings
    are cut as in a stream (the same ``HoldBack``); the generation is stopped at the first.
    """
    channel = DeltaChannel()
    # Nothing leaves before the end, so every token stays held: a phrase whose start came
    # tokens before its end is cut from its start, as a stream's window would if it were long.
    holdback = HoldBack(WHOLE_REPLY, checks, stops)
    parts: list[str] = []
    made: list[TokenLogprob] | None = [] if logprobs else None
    finish_reason = "stop"
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
                    record.on_delta(item.made_at, item.tokens)
                    finish_reason = item.finish_reason or finish_reason
                    if made is not None and item.logprobs:
                        made.extend(item.logprobs)
                    parts.append(holdback.push(item.text, item.tokens)[0])
                    if holdback.ended:  # a check failed, or a stop string completed
                        break
            finally:
                pump_task.cancel()
        if holdback.violation is not None:
            record.outcome, record.reason = "moderated", holdback.violation.check
            payload = moderated_body("".join(parts), holdback.violation)
        elif isinstance(item, End) and item.how == "failed":
            assert item.error is not None
            log.warning("generation failed: %s", item.error)
            record.outcome, record.reason = "errored", item.error.code
            return error_response(500, str(item.error), code=item.error.code)
        elif isinstance(item, End) and item.how == "shutdown":
            record.outcome, record.reason = "shutdown", "shutdown"
            return error_response(503, "the server is shutting down", code="shutdown")
        else:
            parts.append(holdback.finish()[0])
            record.outcome = "finished"
            usage = Usage(prompt_tokens, record.tokens)
            if holdback.stop_sequence is not None:
                finish_reason = "stop"
            # The tokens of the text released (not those of a stop string cut from it).
            shown = None if made is None else tuple(made[: holdback.released_tokens])
            whole = Whole("".join(parts), finish_reason, usage, holdback.stop_sequence, shown)
            payload = body(whole)
        response = json_response(payload)
        record.on_send(len(response.body) if isinstance(response.body, bytes) else 0)
        return response
    except asyncio.CancelledError:
        record.outcome, record.reason = "cancelled", "client_gone"
        raise
    finally:
        await close_quietly(deltas)
        manager.untrack(channel)
        manager.metrics.observe(record)


def json_response(payload: dict[str, Any]) -> web.Response:
    """A compact JSON body (no spaces after separators, as the lab's byte counts assume)."""
    return web.Response(
        text=json.dumps(payload, separators=(",", ":")), content_type="application/json"
    )
