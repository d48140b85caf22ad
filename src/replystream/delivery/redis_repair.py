"""What to write so Redis holds a reply's log again after it lost writes it had acknowledged.

Redis replicates asynchronously: when a primary dies, the replica promoted in its place may
lack the last writes the primary acknowledged. Replication is ordered, so what the new primary
has of a reply's stream is a prefix of what was written, unless a write landed after the loss
(then the stream has a hole). The producing replica still holds its reply's events (its local
copy), so it compares and plans, per reply, one of:

- nothing: Redis's stream is contiguous and holds everything the producer has;
- append: Redis holds a contiguous prefix; the producer re-appends the rest it still holds;
- rewrite: Redis's stream has a hole or more than the producer knows of, or starts after
  the first event the producer holds although Redis never trimmed it (it was evicted, and a
  later append made it anew), or its metadata was lost: the stream is rewritten from the
  producer's copy.

Redis trims a stream only to where the producer's copy starts (the log's bounds: its newest
events, so many and so many bytes of them), so a stream that starts later lost its start.
Whatever the producer no longer holds stays a hole, which readers are told of as a ``gap``;
nothing is replayed wrong. Pure: data in, a plan out.
This file must not know about HTTP, event formats or how Redis is reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from replystream.delivery.replay import LogEntry, data_bytes


@dataclass(frozen=True, slots=True)
class StreamState:
    """What Redis holds of one reply: its stream's first and last sequence numbers (the
    terminal entry included; 0 when empty), its length, whether its metadata is there, and
    whether the reply was deleted (it is not written again)."""

    first: int
    last: int
    length: int
    known: bool
    deleted: bool = False

    @property
    def contiguous(self) -> bool:
        return self.length == 0 or self.length == self.last - self.first + 1


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """What the producer holds of one reply: its kept events (consecutive), the bytes of data
    appended before the first of them, and its ending (None while live)."""

    entries: list[LogEntry]
    bytes_before: int
    ending: str | None
    next_seq: int  # the next event's number: the terminal entry takes it

    @property
    def last(self) -> int:
        """The last sequence number the log will hold in Redis (the terminal one if ended)."""
        return self.next_seq if self.ending is not None else self.next_seq - 1


@dataclass(frozen=True, slots=True)
class Repair:
    """What to write for one reply. ``entries`` are written with the log's size up to each
    (``offsets``); ``missing`` counts the events the producer no longer holds (a hole)."""

    action: Literal["nothing", "append", "rewrite"]
    entries: list[LogEntry]
    offsets: list[int]
    ending: str | None  # the terminal entry to write (at ``ending_seq``), if it must be
    ending_seq: int
    missing: int
    lost: int  # events Redis lacked (lost, or never sent while it was unreachable)


def plan(local: LocalCopy, redis: StreamState) -> Repair:
    """How to make Redis's stream of a reply hold what its producer holds."""
    first_kept = local.entries[0].seq if local.entries else local.next_seq
    # Starting after an event the producer holds: its start is gone (the stream was evicted,
    # then made anew by a later append).
    late = redis.length > 0 and redis.first > first_kept
    whole = redis.known and redis.contiguous and not late
    if whole and redis.last == local.last:
        return Repair("nothing", [], [], None, 0, 0, 0)
    offsets: list[int] = []
    size = local.bytes_before
    for entry in local.entries:
        size += data_bytes(entry.data)
        offsets.append(size)
    if whole and redis.last < local.last:
        # A prefix: re-append what follows it (from the first event the producer holds).
        start = max(redis.last + 1, first_kept)
        keep = [i for i, e in enumerate(local.entries) if e.seq >= start]
        return Repair(
            "append",
            [local.entries[i] for i in keep],
            [offsets[i] for i in keep],
            local.ending,
            local.next_seq,
            missing=max(0, first_kept - (redis.last + 1)),
            lost=local.last - redis.last,
        )
    # A hole, a lost start, a stream ahead of the producer, or metadata lost: the producer's
    # copy wins (a copy trimmed at the start leaves those first events out: readers are told).
    return Repair(
        "rewrite",
        local.entries,
        offsets,
        local.ending,
        local.next_seq,
        missing=first_kept - 1,
        lost=max(0, local.last - redis.length),
    )
