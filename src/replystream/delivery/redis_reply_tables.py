"""What the log writer holds of each reply produced here: which are live, what is queued for
them, which failed or were deleted, what Redis may have lost.

The writing half (``redis_log_writer``: queueing, flushing) and the failover half
(``redis_failover``: finding out what Redis lost, writing it again) both change these tables,
so they live here, in one place. A change that touches several tables at once is a method of
this class, so none is left behind. This file sends nothing and reads no store.
"""

from __future__ import annotations

from replystream.delivery.replay import LogEntry


class ReplyTables:
    """The per-reply state of the replies produced here, each table keyed by reply id."""

    __slots__ = (
        "deleted",
        "dirty",
        "endings",
        "expire_due",
        "failures",
        "live",
        "logged",
        "lost",
        "next_seq",
        "pending",
        "read_elsewhere",
    )

    def __init__(self) -> None:
        self.live: set[str] = set()  # replies produced here and not ended
        # Replies produced here, deleted before their end: what they append is dropped.
        self.deleted: set[str] = set()
        # Queued for the next flush: entries and endings.
        self.pending: dict[str, list[LogEntry]] = {}
        self.endings: dict[str, tuple[int, str]] = {}
        self.next_seq: dict[str, int] = {}
        # Replies whose writes failed: their producers stop, and Redis gets no more of them
        # (a repair too would fail, or write what Redis refused). Kept until the reply has
        # ended and its copy here is gone (``LogWriter.prune``).
        self.failures: dict[str, str] = {}
        # Replies produced here that a reader elsewhere found lost (this process stalled):
        # Redis, which took nothing after that, answers their new readers, not the copy
        # here. Kept as long as their failure is.
        self.lost: set[str] = set()
        # Replies produced here: when the heartbeat last found a reader's mark from elsewhere.
        self.read_elsewhere: dict[str, float] = {}
        self.logged: dict[str, int] = {}  # bytes sent to Redis per live reply: entries' offsets
        # When each live reply's keys must have their TTL refreshed (absent: not yet written).
        self.expire_due: dict[str, float] = {}
        # Failover: replies whose log Redis may have lost part of.
        self.dirty: set[str] = set()

    def forget(self, reply_id: str) -> None:
        """Drop everything held of a deleted reply; one still live is marked deleted, so that
        what its producer appends and ends while winding down is dropped too."""
        if reply_id in self.live:
            self.live.discard(reply_id)
            self.deleted.add(reply_id)
        self.pending.pop(reply_id, None)
        self.endings.pop(reply_id, None)
        self.next_seq.pop(reply_id, None)
        self.failures.pop(reply_id, None)
        self.lost.discard(reply_id)
        self.logged.pop(reply_id, None)
        self.expire_due.pop(reply_id, None)
        self.read_elsewhere.pop(reply_id, None)
        self.dirty.discard(reply_id)

    def ended_unsent(self, reply_id: str) -> None:
        """An ended reply whose ending no flush will send (its writes failed, a repair wrote
        it, or writes failed for too long): the offsets and TTL kept for its next write go."""
        self.logged.pop(reply_id, None)
        self.expire_due.pop(reply_id, None)
