"""What Redis holds of replies a failover or an eviction may have cut, and the writes that
make it whole again: the I/O around ``redis_repair``'s plans.

``stream_states`` asks, per reply, its stream's first and last entries, its length and
whether its metadata holds an owner or the mark of a delete (one pipeline); ``write_repair``
queues one plan's writes on a pipeline: a rewrite deletes the stream and sets the metadata
again, then the entries (with the log's size up to each), the terminal entry and the
ending's marks, or the liveness key of a reply still generated, and the TTLs. The store
sends the pipeline and counts it. This file knows the keys' parts (``:meta``, ``:live``) and
entries' fields, not the prefix, and must not know about HTTP or event formats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from redis.typing import EncodableT, FieldT

from replystream.delivery.redis_connect import RedisClient
from replystream.delivery.redis_repair import Repair, StreamState
from replystream.delivery.redis_rows import seq_of
from replystream.delivery.replay import ReplyInfo

KeyOf = Callable[..., str]  # (reply id[, part]) -> key


def ended_fields(ending: str, ending_seq: int) -> Mapping[FieldT, EncodableT]:
    """What an ended reply leaves in its metadata (as the write script writes it), so a
    reader can tell a stream evicted after the end from a producer lost before it."""
    return {"end": ending, "last": ending_seq - 1}


async def stream_states(
    redis: RedisClient, key_of: KeyOf, reply_ids: list[str]
) -> dict[str, StreamState]:
    async with redis.pipeline(transaction=False) as pipe:
        for reply_id in reply_ids:
            key = key_of(reply_id)
            pipe.xrange(key, min="-", max="+", count=1)
            pipe.xrevrange(key, max="+", min="-", count=1)
            pipe.xlen(key)
            # A heartbeat may have made the hash again with only its count: known means
            # the owner is there.
            pipe.hexists(key_of(reply_id, ":meta"), "owner")
            pipe.hexists(key_of(reply_id, ":meta"), "deleted")
        results = await pipe.execute()
    states = {}
    for n, reply_id in enumerate(reply_ids):
        first, last, length, known, deleted = results[5 * n : 5 * n + 5]
        states[reply_id] = StreamState(
            seq_of(first[0][0]) if first else 0,
            seq_of(last[0][0]) if last else 0,
            int(length),
            bool(known),
            bool(deleted),
        )
    return states


def write_repair(
    pipe: Any,
    key_of: KeyOf,
    info: ReplyInfo,
    repair: Repair,
    *,
    ttl_s: float,
    live_s: float | None,
    max_entries: int,
) -> int | None:
    """Queue ``repair``'s writes for reply ``info`` (``live_s``: its liveness, while it is
    generated); return the log's size after them when it goes on being written, else None."""
    if repair.action == "nothing":
        return None
    reply_id = info.reply_id
    key = key_of(reply_id)
    if repair.action == "rewrite":
        # Readers meanwhile find an empty stream and wait, or events after a hole: told.
        pipe.delete(key)
        pipe.hset(key_of(reply_id, ":meta"), mapping={"owner": info.owner, "context": info.context})
    for entry, offset in zip(repair.entries, repair.offsets, strict=True):
        pipe.xadd(
            key,
            {"e": entry.event or "", "d": entry.data, "b": offset},
            id=f"0-{entry.seq}",
            maxlen=max_entries,
            approximate=True,
        )
    logged = None
    if repair.ending is not None:
        pipe.xadd(key, {"end": repair.ending}, id=f"0-{repair.ending_seq}")
        pipe.hset(key_of(reply_id, ":meta"), mapping=ended_fields(repair.ending, repair.ending_seq))
    elif live_s is not None:
        pipe.set(key_of(reply_id, ":live"), b"1", ex=max(1, int(live_s)))
        if repair.offsets:
            logged = repair.offsets[-1]
    for part in ("", ":meta"):
        pipe.expire(key_of(reply_id, part), max(1, int(ttl_s)))
    return logged
