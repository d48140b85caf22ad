"""Cancels asked by a client, and the wait for the ending they lead to.

A cancel (``POST /v1/replies/{id}/cancel``, ``POST /v1/responses/{id}/cancel``) is asked of
the reply's producer through its store, on whichever replica runs it, and may meet the
reply's own end: the producer may have decided its ending (its last token made, its engine
stream closing) before the cancel reaches it, and then ends as it would have. The routes
answer with the ending, not with what was asked: ``cancel`` says whether the cancel is what
stopped the reply, and ``until_ended`` waits for a reply's log to end (a Responses cancel
answers with the object once it has). This file must not know HTTP.
"""

from __future__ import annotations

import asyncio

from replystream.delivery.replay import ReadResult, ReplayStore, entries_bytes
from replystream.server.replies import Reply

# How long a cancel waits for the reply's ending before it answers with its state then
# (another replica's producer hears of the cancel at once on the cancels' channel, or at
# its next heartbeat, within a second).
CANCEL_WAIT_S = 5.0
ENDING_POLL_S = 1.0  # how long one read of a reply's log may wait for more
# How a reply stopped by a cancel request is counted (``Reply.how_ended``).
CANCELLED = ("cancelled", "cancelled")


async def cancel(store: ReplayStore, reply_id: str, local: Reply | None) -> bool:
    """Stop reply ``reply_id`` (``local``: its producer, when it runs in this process): True
    if this cancel stopped it (or one asked before it did), False if it had ended, or its
    ending was decided otherwise (its last token made, a check) before the cancel reached
    its producer. A producer elsewhere that has not ended within ``CANCEL_WAIT_S`` was asked,
    and the answer is True. Raises ``StoreUnavailable``."""
    tail = await store.tail(reply_id)
    if tail is None or tail.ended:
        return False
    await store.request_cancel(reply_id)  # the store reaches the producer, here or not
    if local is not None:
        # Made here: its ending is decided now, by this cancel unless by something before it.
        return local.how_ended() == CANCELLED
    ended = await until_ended(store, reply_id, CANCEL_WAIT_S)
    if ended is None:  # still running (its producer has not heard yet), or deleted since
        return True
    # The log's word for every stop (``EndingRule.log_end``): a reply stopped elsewhere
    # just before (its client gone) reads as cancelled too, as its readers are told.
    return ended.ending == "cancelled"


async def until_ended(
    store: ReplayStore, reply_id: str, within_s: float | None = None
) -> ReadResult | None:
    """Wait until a reply's log has its ending, or its producer is gone: the read that found
    it; None if the log is gone (expired, deleted), or, with ``within_s``, it had not ended
    when that many seconds were up. With ``within_s``, no read begins after that time; a read
    under way then is let finish rather than cut: one that found its producer's liveness key
    gone is making sure it died (its heartbeat count still, ``BEAT_CONFIRM_S``), and cut,
    that would begin again for the answer. Raises ``StoreUnavailable``."""
    loop = asyncio.get_running_loop()
    deadline = None if within_s is None else loop.time() + within_s
    cursor = store.cursor(reply_id, 0)
    try:
        while True:
            wait_s = ENDING_POLL_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - loop.time())
                if wait_s <= 0:
                    return None
            result = await cursor.read(wait_s)
            if result is None:
                return None
            if result.ending is not None or result.producer_lost:
                return result
            if result.entries:
                cursor.sent(result.entries[-1].seq, entries_bytes(result.entries))
    finally:
        cursor.close()
