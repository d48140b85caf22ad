"""What Redis holds of replies a failover or an eviction may have cut, and the writes that
make it whole again: the I/O around ``redis_repair``'s plans.

``stream_states`` asks, per reply, its stream's first and last entries, its length and
whether its metadata holds an owner or the mark of a delete (one pipeline); ``write_repair``
queues one plan's writes on a pipeline as one script call (``REPAIR_SCRIPT``): a rewrite
deletes the stream and sets the metadata again, then the entries (with the log's size up to
each), the terminal entry and the ending's marks, or the liveness key of a reply still
generated, and the TTLs. One script, so Redis runs a reply's repair whole, with no other
command between its writes: a reader never finds the stream of an ended reply deleted or
half written again while its metadata says it ended (it would take the rest for lost). The
store sends the pipeline and counts it. This file knows the keys' parts (``:meta``,
``:live``) and entries' fields, not the prefix, and must not know about HTTP or event
formats.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from replystream.delivery.redis_connect import RedisClient
from replystream.delivery.redis_link import live_hold_s, ttl_whole_s
from replystream.delivery.redis_repair import Repair, StreamState
from replystream.delivery.redis_rows import seconds_field, seq_of
from replystream.delivery.replay import ReplyInfo

KeyOf = Callable[..., str]  # (reply id[, part]) -> key

# KEYS: a reply's stream, meta and live keys. ARGV[1]: JSON [rewrite (1: the stream is
# written anew, 0: appended to), owner, context, TTL, liveness (0: not generated), the
# first entry kept (the producer's copy's: older ones are trimmed; 0 or 1: none), ending
# (null: none), the terminal entry's number, the stream's last entry and length as planned
# from, the dialect (``ReplyInfo.dialect``), the keep-alive interval asked (its
# ``keepalive_s`` as text; "": none), then 4 values per entry: seq, type ("": none), data,
# log size]. A reply deleted since its state was read is left alone (a delete's mark
# is never written over): 0; so is one whose producer was found lost (``LOST_SCRIPT``: its
# readers were told so; its producer hears at its next heartbeat). An
# append to a stream that is no longer as it was read (another primary answered that read,
# while a demoted one still took writes) writes nothing either, as it would leave a hole: 2,
# and the repair is planned again. The ending's marks in the metadata are
# those the write script leaves (``redis_writes``), so a reader can tell a stream evicted
# after the end from a producer lost before it.
REPAIR_SCRIPT = """
local r = cjson.decode(ARGV[1])
local stream, meta = KEYS[1], KEYS[2]
if redis.call('HEXISTS', meta, 'deleted') == 1 then return 0 end
if redis.call('HEXISTS', meta, 'lost') == 1 then return 0 end
if r[1] == 1 then
  redis.call('DEL', stream)
  redis.call('HSET', meta, 'owner', r[2], 'context', r[3])
  if r[11] ~= '' then redis.call('HSET', meta, 'dialect', r[11]) end
  if r[12] ~= '' then redis.call('HSET', meta, 'keepalive', r[12]) end
else
  local length = redis.call('XLEN', stream)
  if length ~= r[10] or redis.call('HEXISTS', meta, 'owner') == 0 then return 2 end
  if length > 0 then
    local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1][1]
    if last ~= '0-' .. r[9] then return 2 end
  end
end
for j = 13, #r, 4 do
  redis.call('XADD', stream, '0-' .. r[j], 'e', r[j + 1], 'd', r[j + 2], 'b', r[j + 3])
end
if r[6] > 1 then redis.call('XTRIM', stream, 'MINID', '~', '0-' .. r[6]) end
if r[7] ~= cjson.null then
  redis.call('XADD', stream, '0-' .. r[8], 'end', r[7])
  redis.call('HSET', meta, 'end', r[7], 'last', r[8] - 1)
elseif r[5] > 0 then
  redis.call('SET', KEYS[3], '1', 'EX', r[5])
end
redis.call('EXPIRE', stream, r[4])
redis.call('EXPIRE', meta, r[4])
return 1
"""
# Raw UTF-8, as the write script's argument: Lua's cjson keeps it byte for byte.
_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))


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
    state: StreamState,
    *,
    ttl_s: float,
    live_s: float | None,
    kept_from: int,
) -> int | None:
    """Queue ``repair``'s writes for reply ``info`` (``live_s``: its liveness, while it is
    generated), planned from ``state``, as one script call (none for nothing to write);
    return the log's size after them when it goes on being written, else None."""
    if repair.action == "nothing":
        return None
    reply_id = info.reply_id
    generated = max(1, int(live_s)) if live_s is not None and repair.ending is None else 0
    # A reply still generated keeps its keys from beat to beat (``live_hold_s``).
    ttl = live_hold_s(ttl_s, live_s) if live_s is not None and generated else ttl_whole_s(ttl_s)
    argument: list[object] = [
        1 if repair.action == "rewrite" else 0,
        info.owner,
        info.context,
        ttl,
        generated,
        kept_from,
        repair.ending,
        repair.ending_seq,
        state.last,
        state.length,
        info.dialect,
        seconds_field(info.keepalive_s),
    ]
    for entry, offset in zip(repair.entries, repair.offsets, strict=True):
        argument += (entry.seq, entry.event or "", entry.data, offset)
    # EVAL, not EVALSHA: a Cluster's pipeline cannot load a script on the node it reaches
    # first, and a repair is rare enough that sending the script's text costs nothing.
    keys = (key_of(reply_id), key_of(reply_id, ":meta"), key_of(reply_id, ":live"))
    pipe.eval(REPAIR_SCRIPT, len(keys), *keys, _ENCODER.encode(argument))
    if generated and repair.offsets:
        return repair.offsets[-1]
    return None
