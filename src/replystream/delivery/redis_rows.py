"""A reply log's Redis stream entries and metadata, read back into events and what is lost.

Stream entry ``0-<seq>`` holds one event (field ``e``: its type, empty for a plain message;
``d``: its data; ``b``: the log's size in bytes up to and including it; ``a``, on the last of
several entries one write added: the log's size before the first of them); the terminal
entry holds the ending (``end``). An ended reply's metadata keeps its ending and last event's
number (``end``, ``last``). Every reader of Redis (a read of its own, or its share of the
shared ``XREAD``) turns entries into a ``ReadResult`` here, so each tells lost events the
same way: entries that start after the reader's place (trimmed, evicted), or a hole in the
numbers (Redis lost events nobody could write again), stop the read before the jump, and the
next read is told what is missing. Pure: rows in, results out. This file must not know how
Redis is reached, nor about HTTP or event formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from replystream.delivery.replay import LogEntry, ReadResult

# The metadata's fields a read needs: whether it is there (every reply has an owner, "" with
# auth off), the ending and last event's number an ended reply leaves in it, the mark a
# delete leaves in its place, and the mark of a producer found lost (``redis_writes``).
META_READ = ("owner", "end", "last", "deleted", "lost")


class Offsets(NamedTuple):
    """Where a read's entries stand in the log, in bytes of data."""

    before_first: int | None  # the log's size before the first entry read (None: none read)
    logged: int | None  # the log's size so far (None: not known from this read)


class Meta(NamedTuple):
    """What a read learns from a reply's metadata (``META_READ``)."""

    known: bool  # the metadata is there (it may be evicted while the stream survives)
    ending: str | None  # the reply has ended so
    last: int  # its last event's number (when ended)
    # Deleted: whatever its producer writes until it hears of it is not the reply.
    deleted: bool
    # Its producer was found lost, and readers told so: the reply takes no more events.
    lost: bool

    @classmethod
    def of(cls, fields: Sequence[bytes | None]) -> Meta:
        owner, end, last, deleted, lost = fields
        ending = None if end is None else end.decode()
        last_seq = int(last) if last is not None else 0
        return cls(owner is not None, ending, last_seq, deleted is not None, lost is not None)


def seq_of(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1])


def text(value: bytes | str | None) -> str:
    """A hash field's value as text ("" when absent)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def seconds_field(value: float | None) -> str:
    """A duration kept in a reply's metadata (``ReplyInfo.keepalive_s``) as a hash field's
    text, the shortest that reads back as the same float; "" (not kept) for None."""
    return "" if value is None else repr(value)


def seconds_of(value: bytes | str | None) -> float | None:
    """A duration ``seconds_field`` kept (None when absent)."""
    kept = text(value)
    return float(kept) if kept else None


class Newest(NamedTuple):
    """What a log's newest entries tell of it, in bytes of data."""

    logged: int | None  # its size (None: no event logged yet)
    latest: int  # what its latest write added (a write of one entry: that entry)


def newest_write(newest: Any) -> Newest:
    """The log's size and its latest write's bytes, from its newest entries (newest first;
    the terminal one has neither)."""
    for _, fields in newest or ():
        if b"b" in fields:
            logged = int(fields[b"b"])
            began = int(fields[b"a"]) if b"a" in fields else logged - len(fields[b"d"])
            return Newest(logged, logged - began)
    return Newest(None, 0)


def result_of(rows: Any, after: int, batch: int) -> tuple[ReadResult, Offsets]:
    """A read's result from the stream entries after ``after`` (at most ``batch`` of them),
    and where they stand in bytes (the log's size: as far as these entries tell)."""
    entries: list[LogEntry] = []
    ending: str | None = None
    last_seq: int | None = None
    before_first: int | None = None
    logged: int | None = None
    hole = False
    expected: int | None = None
    for entry_id, fields in rows:
        seq = seq_of(entry_id)
        if expected is not None and seq != expected:
            # A hole (Redis lost events its producer could not write again): stop before
            # it, so the next read, after the last event before it, is told what is lost.
            hole = True
            break
        expected = seq + 1
        if b"end" in fields:
            ending = fields[b"end"].decode()
            last_seq = seq - 1  # the terminal entry comes right after the last event
            break
        raw = fields[b"d"]
        if b"b" in fields:
            logged = int(fields[b"b"])
            if before_first is None:
                before_first = logged - len(raw)  # the offsets count the data's UTF-8 bytes
        entries.append(LogEntry(seq, fields[b"e"].decode() or None, raw.decode()))
    offsets = Offsets(before_first, logged)
    lost = None
    first = seq_of(rows[0][0]) if rows else None
    if first is not None and first > after + 1:
        lost = (after + 1, first - 1)
    if hole or (len(rows) == batch and ending is None):
        return ReadResult(entries, lost, None), offsets  # more to come on the next read
    return ReadResult(entries, lost, ending, last_seq=last_seq), offsets
