"""The Redis reply log's writes, batched: everything queued goes to Redis in one script call.

A reply's events arrive one at a time, from thousands of replies at once; through redis-py a
command costs the replica more CPU than the event did to produce (packing its arguments and
reading its answer, in Python). So one flush sends one ``EVALSHA`` of ``WRITE_SCRIPT``: the
keys it touches, and one JSON text (encoded by the C encoder, in one call) holding the new
replies, every reply's new entries and its ending; Redis runs the ``XADD``s. Per event the
replica builds one row; per reply and flush, one key. Expiry and trimming are not per event
either: a stream's TTL is set on its first write (and by any write that makes it again, found
by ``XADD ... NOMKSTREAM``: Redis 6.2 or later), refreshed every third of the TTL while the
reply lives and at its end, and ``MINID`` is asked for only once the producer's own copy of
a reply has dropped its oldest entries (its count or its bytes past the log's bounds): Redis
keeps what that copy keeps. A write that fails fails its reply alone (the others in the
batch go on).

The call also marks an ended reply's metadata (``end``, ``last``) and counts itself (an
``INCR`` of the writer's count, last), so acknowledged writes a failover lost are found; it
first checks that count, and writes nothing unless Redis holds exactly the count the writer's
last call left: fewer, and calls were lost (a failover), more, and another primary took the
writer's last calls (a demoted one that still takes writes, while the client reaches both):
either way an entry written now would land past a hole, where a reader elsewhere would take
the events in it for lost before the producer has written them again (``redis_failover``). The
liveness refresh is one call too (``HEARTBEAT_SCRIPT``), which also keeps a live reply's keys
(their TTL, however long it goes without an event), bumps its heartbeat count and asks its
stream's length (eviction checks), finds a reply deleted
on another replica (``DELETE_SCRIPT`` leaves a mark in its metadata's place), and whether a
reader on another replica follows it (its reader mark).
``flush_batches`` plans one
flush from what is queued. This file knows the stream entries' fields and which of a reply's
keys each write touches, but not how keys are named (the store passes its naming).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

from redis.crc import key_slot

from replystream.delivery.redis_rows import seconds_field
from replystream.delivery.replay import LogEntry, ReplyInfo, data_bytes

# ARGV[1]: JSON [ttl, hold, liveness, counter key index, creates, replies, expected], flat
# where it can be (the encoder's cost is per list as much as per value). ttl: an ended reply's
# keys' life; hold: a live reply's, from each refresh (``redis_link.live_hold_s``); expected:
# the writer's count Redis must hold before this call (0: unknown, not checked).
#   creates: [meta key index, live key index, owner, context, dialect ("": none, not kept),
#             keep-alive interval asked (``ReplyInfo.keepalive_s``, as text; "": none, not kept)]
#   replies: [stream key index, first entry kept (0: no trim), indices of keys to expire, ending
#             ([seq, text, meta key index]) or null, live key index to delete (0: none), then
#             4 values per entry: seq, type ("": none), data, log size (the last of several
#             entries also gets the log's size before the first: ``redis_rows``)]
# A reply deleted (``DELETE_SCRIPT``) on another replica is written to until its producer
# hears of it at its next heartbeat: its stream, which the delete removed, is not made again
# (a reader following it would read what was said after the delete, or a gap where the
# deleted events were); its ending, if it comes first, deletes what was. A reply whose
# producer was found lost (``LOST_SCRIPT``) takes nothing more: refused, ``LOST_REFUSAL``.
# Returns {count, index, error, index, error, ...}: the writer's count of its calls after this
# one (INCR-ed last, so a count that survives a failover vouches for every write before it),
# then the replies (from 0) whose writes Redis refused; or {0, count} when the count Redis
# holds is not the expected one (fewer: calls acknowledged, then lost in a failover, or the
# count evicted or gone with a restart; more: another primary answered the last calls), and
# nothing was written. A refusal that is the reply's own (its
# ids, its key's type: ``ERR``, ``WRONGTYPE``) fails that reply alone; any other (``READONLY``
# from a demoted primary, ``OOM``, ...) fails the whole call, as a lost connection does, so
# the store retries and repairs instead of stopping replies.
WRITE_SCRIPT = """
local batch = cjson.decode(ARGV[1])
local ttl, hold, liveness = batch[1], batch[2], batch[3]
local counter = KEYS[batch[4]]
if batch[7] > 0 then
  local held = tonumber(redis.call('GET', counter) or '0')
  if held ~= batch[7] then return {0, held} end
end
local function refused(res)
  if type(res) ~= 'table' or not res.err then return nil end
  local err = res.err
  if string.sub(err, 1, 4) == 'ERR ' or string.sub(err, 1, 10) == 'WRONGTYPE ' then
    return err
  end
  error(res)
end
for _, c in ipairs(batch[5]) do
  redis.call('HSET', KEYS[c[1]], 'owner', c[3], 'context', c[4], 'beat', 1)
  if c[5] ~= '' then redis.call('HSET', KEYS[c[1]], 'dialect', c[5]) end
  if c[6] ~= '' then redis.call('HSET', KEYS[c[1]], 'keepalive', c[6]) end
  redis.call('EXPIRE', KEYS[c[1]], hold)
  redis.call('SET', KEYS[c[2]], '1', 'EX', liveness)
end
-- One reply's entries and ending; what Redis refused of them, if anything.
local function write(r)
  local key, trim, ending = KEYS[r[1]], r[2], r[4]
  -- Its producer was found lost (``LOST_SCRIPT``) and its readers told so: it was stalled,
  -- and is back. Nothing it says now is the reply.
  if redis.call('HEXISTS', key .. ':meta', 'lost') == 1 then return 'LOST' end
  local life = hold
  if ending ~= cjson.null then life = ttl end
  -- Whether this call made the stream: one gone (evicted, expired) is made again by the
  -- first entry, and given its TTL here, so it never outlives the reply should its producer
  -- die before it hears. One deleted on another replica is not: nothing more of it is kept.
  local made = false
  -- The last of several entries also carries the log's size before the first ('a'), so a
  -- reader on another replica tells this write's bytes from those before it.
  local none = {}
  local began = none
  if #r > 9 then began = {'a', r[9] - #r[8]} end
  for j = 6, #r, 4 do
    local id = '0-' .. r[j]
    local tail = none
    if j == #r - 3 then tail = began end
    local res
    if j == 6 then
      if trim > 0 then
        res = redis.pcall('XADD', key, 'NOMKSTREAM', 'MINID', '~', '0-' .. trim, id,
          'e', r[7], 'd', r[8], 'b', r[9])
      else
        res = redis.pcall('XADD', key, 'NOMKSTREAM', id, 'e', r[7], 'd', r[8], 'b', r[9])
      end
      if res == false then
        -- Its metadata's key (``redis_keys``: the stream's and ':meta', in its hash slot), read
        -- only when the stream is gone rather than sent with every write.
        if redis.call('HEXISTS', key .. ':meta', 'deleted') == 1 then return nil end
        made = true
        res = redis.pcall('XADD', key, id, 'e', r[7], 'd', r[8], 'b', r[9])
      end
    elseif trim > 0 then
      res = redis.pcall('XADD', key, 'MINID', '~', '0-' .. trim, id, 'e', r[j + 1],
        'd', r[j + 2], 'b', r[j + 3], unpack(tail))
    else
      res = redis.pcall('XADD', key, id, 'e', r[j + 1], 'd', r[j + 2], 'b', r[j + 3],
        unpack(tail))
    end
    local err = refused(res)
    if err then return err end
  end
  if made then redis.call('EXPIRE', key, life) end
  if ending ~= cjson.null then
    local err = refused(redis.pcall('XADD', key, '0-' .. ending[1], 'end', ending[2]))
    if err then return err end
    -- Left in the metadata, so a reader tells a stream evicted after the end from a
    -- producer lost before it.
    redis.call('HSET', KEYS[ending[3]], 'end', ending[2], 'last', ending[1] - 1)
  end
  for _, k in ipairs(r[3]) do redis.call('EXPIRE', KEYS[k], life) end
  if r[5] > 0 then redis.call('DEL', KEYS[r[5]]) end
  return nil
end
local out = {0}
for i, r in ipairs(batch[6]) do
  local ending = r[4]
  if ending ~= cjson.null and redis.call('HEXISTS', KEYS[ending[3]], 'deleted') == 1 then
    -- Deleted on another replica before its producer heard: what it wrote since goes.
    redis.call('DEL', KEYS[r[1]])
    if r[5] > 0 then redis.call('DEL', KEYS[r[5]]) end
  else
    local err = write(r)
    if err then
      out[#out + 1] = i - 1
      out[#out + 1] = err
    end
  end
end
out[1] = redis.call('INCR', counter)
redis.call('EXPIRE', counter, hold)
return out
"""

# KEYS: live, cancel, meta, stream and reader keys of each reply; ARGV[1]: liveness in
# seconds; ARGV[2]: how long the metadata and the stream of a live reply are kept from this
# beat (``redis_link.live_hold_s``: a reply that makes no event for longer than the TTL still
# lives, and a metadata hash the count makes anew gets it). Returns, per reply: 1 if a cancel was
# requested (else 0), its heartbeat count after this beat (1: its metadata was gone; 0: the
# reply was deleted, and what its producer wrote of it since is deleted now; -1: its producer
# was found lost, ``LOST_SCRIPT``, and its liveness is not refreshed), its stream's
# length (shorter than what Redis acknowledged: evicted), and 1 if a reader on another
# replica follows it (else 0).
HEARTBEAT_SCRIPT = """
local out = {}
for i = 1, #KEYS, 5 do
  if redis.call('HEXISTS', KEYS[i + 2], 'deleted') == 1 then
    redis.call('DEL', KEYS[i], KEYS[i + 1], KEYS[i + 3])
    out[#out + 1] = 1
    out[#out + 1] = 0
    out[#out + 1] = 0
    out[#out + 1] = 0
  elseif redis.call('HEXISTS', KEYS[i + 2], 'lost') == 1 then
    -- Found lost while its producer was stalled: it is not made live again.
    out[#out + 1] = 0
    out[#out + 1] = -1
    out[#out + 1] = 0
    out[#out + 1] = 0
  else
    redis.call('SET', KEYS[i], '1', 'EX', ARGV[1])
    out[#out + 1] = redis.call('EXISTS', KEYS[i + 1])
    out[#out + 1] = redis.call('HINCRBY', KEYS[i + 2], 'beat', 1)
    out[#out + 1] = redis.call('XLEN', KEYS[i + 3])
    redis.call('EXPIRE', KEYS[i + 2], ARGV[2])
    redis.call('EXPIRE', KEYS[i + 3], ARGV[2])
    out[#out + 1] = redis.call('EXISTS', KEYS[i + 4])
  end
end
return out
"""

# KEYS: a reply's stream, meta, live and cancel keys; ARGV[1]: how long its mark lives.
# Deletes them, and leaves in the metadata's place a mark that readers take for a reply that
# is gone, that a repair after a failover does not write over, and that its producer, on any
# replica, finds at its next heartbeat: it stops, and what it wrote meanwhile is deleted.
DELETE_SCRIPT = """
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[2], 'deleted', 1)
redis.call('EXPIRE', KEYS[2], ARGV[1])
"""

# What ``WRITE_SCRIPT`` answers for a reply found lost, which its producer tells from any
# other refusal (those begin ``ERR `` or ``WRONGTYPE ``).
LOST_REFUSAL = "LOST"

# KEYS: a reply's meta, live and stream keys; ARGV[1]: its heartbeat count as a reader saw it
# stand still ("": none), ARGV[2]: the number of the last event that reader has. A reader
# that found the producer's liveness key gone and its count still settles it lost, here, for
# every replica: the metadata is marked ``lost``, so every later read (a resume, a response's
# object, on any replica) is told so at once, and the producer, should it come back (a
# process stopped and let go on, a VM frozen, a partition healed), finds its writes refused
# (``WRITE_SCRIPT``) and its liveness no longer refreshed (``HEARTBEAT_SCRIPT``), and stops:
# no reader is told the reply is lost and then finds it going on. Unless the producer moved
# meanwhile (its liveness key back, its count moved, an event past that reader's last, or the
# reply ended): then 0, and nothing is marked; else 1 (marked now, or before). Metadata gone
# or deleted is not marked (1: nothing says a producer lives).
LOST_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local meta = redis.call('HMGET', KEYS[1], 'owner', 'end', 'deleted', 'lost', 'beat')
if meta[4] then return 1 end
if meta[2] then return 0 end
if not meta[1] or meta[3] then return 1 end
if (meta[5] or '') ~= ARGV[1] then return 0 end
local newest = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)[1]
if newest and tonumber(string.sub(newest[1], 3)) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'lost', 1)
return 1
"""


# One reply's record: stream key index, trim, keys to expire, ending, live key index, then
# 4 values per entry.
ReplyWrite = list[int | str | list[int] | tuple[int, str, int] | None]
# Compact, and no check for cycles: the batch is built here from flat values.
_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))


class WriteBatch:
    """One flush's writes, laid out for ``WRITE_SCRIPT``."""

    __slots__ = ("_creates", "_replies", "keys", "reply_ids")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.reply_ids: list[str] = []  # in the order of the script's replies
        self._creates: list[tuple[int, int, str, str, str, str]] = []
        self._replies: list[ReplyWrite] = []

    def _index(self, key: str) -> int:
        self.keys.append(key)
        return len(self.keys)  # Lua counts from 1

    def create(self, meta_key: str, live_key: str, info: ReplyInfo) -> None:
        self._creates.append(
            (
                self._index(meta_key),
                self._index(live_key),
                info.owner,
                info.context,
                info.dialect,
                seconds_field(info.keepalive_s),
            )
        )

    def reply(
        self,
        reply_id: str,
        stream_key: str,
        entries: Sequence[LogEntry],
        logged: int,
        *,
        trim: int,
        expire: Sequence[str],
        ending: tuple[int, str] | None = None,
        meta_key: str = "",
        live_key: str | None = None,
    ) -> int:
        """Queue ``entries`` (and the ending, if any, also marked in ``meta_key``) of one
        reply, whose log held ``logged`` bytes before them; return the log's size after them."""
        stream = self._index(stream_key)
        indices = {stream_key: stream}
        for key in expire:
            if key not in indices:
                indices[key] = self._index(key)
        expired = [indices[key] for key in expire]
        marked = None
        if ending is not None:
            meta = indices.get(meta_key) or self._index(meta_key)
            marked = (ending[0], ending[1], meta)
        live = self._index(live_key) if live_key is not None else 0
        record: ReplyWrite = [stream, trim, expired, marked, live]
        for entry in entries:
            logged += data_bytes(entry.data)
            # Each entry carries the log's size in bytes up to and including it, so a reader
            # on any replica can tell how far behind it is.
            record += (entry.seq, entry.event or "", entry.data, logged)
        self.reply_ids.append(reply_id)
        self._replies.append(record)
        return logged

    def __bool__(self) -> bool:
        return bool(self._creates or self._replies)

    def argument(
        self, ttl: int, hold: int, liveness: int, counter_key: str, expected: int = 0
    ) -> str:
        """The script's one argument (raw UTF-8: Lua's cjson keeps it byte for byte), with
        the key of the writer's call count and the count it must hold before this call
        (``expected``, 0: not checked; see ``WRITE_SCRIPT``)."""
        counter = self._index(counter_key)
        return _ENCODER.encode(
            [ttl, hold, liveness, counter, self._creates, self._replies, expected]
        )


_slot_tags: dict[int, str] = {}
_tags_tried = 0


def slot_tag(slot: int) -> str:
    """A short hash tag whose key slot is ``slot``: a key holding it in braces lives in that
    slot (the writer's call count per slot, next to the replies it counts). Found by trying
    ``0``, ``1``, ... once for all slots: about 110,000 tries in all, spread over first uses."""
    global _tags_tried
    while slot not in _slot_tags:
        tag = str(_tags_tried)
        _tags_tried += 1
        _slot_tags.setdefault(key_slot(tag.encode()), tag)
    return _slot_tags[slot]


# What a flush is waited on by: the creates in it (None once written, or why not).
Waiting = list[asyncio.Future[str | None]]


def flush_batches(
    creates: list[tuple[ReplyInfo, asyncio.Future[str | None]]],
    pending: dict[str, list[LogEntry]],
    endings: dict[str, tuple[int, str]],
    *,
    key: Callable[..., str],
    per_slot: bool,
    kept_from: Callable[[str], int],
    refresh_s: float,
    logged: dict[str, int],
    expire_due: dict[str, float],
) -> dict[int, tuple[WriteBatch, Waiting]]:
    """What one flush writes (new replies, then each reply's entries and ending), in one
    batch, or one per hash slot (``per_slot``); each with the creates waiting on it. ``key``
    names a reply's keys (``key(reply_id)``, ``key(reply_id, ":meta")``); ``kept_from`` the
    first entry of a reply the producer's copy keeps; ``logged`` (bytes
    written per live reply) and ``expire_due`` (when its keys' TTL is refreshed next, every
    ``refresh_s``) are the store's, updated here."""
    groups: dict[int, tuple[WriteBatch, Waiting]] = {}

    def batch_for(stream: str) -> tuple[WriteBatch, Waiting]:
        slot = key_slot(stream.encode()) if per_slot else 0
        group = groups.get(slot)
        if group is None:
            group = groups[slot] = (WriteBatch(), [])
        return group

    for info, written in creates:
        batch, waiting = batch_for(key(info.reply_id))
        batch.create(key(info.reply_id, ":meta"), key(info.reply_id, ":live"), info)
        waiting.append(written)
    now = time.monotonic()
    for reply_id in (pending.keys() | endings.keys()) if endings else pending.keys():
        entries = pending.get(reply_id, ())
        ending = endings.get(reply_id)
        stream = key(reply_id)
        batch = batch_for(stream)[0]
        first_kept = kept_from(reply_id)
        trim = first_kept if first_kept > 1 else 0
        if ending is not None:
            # Every key lives the TTL from the reply's end.
            meta = key(reply_id, ":meta")
            expire: tuple[str, ...] = (stream, meta, key(reply_id, ":cancel"))
            expire_due.pop(reply_id, None)
            batch.reply(
                reply_id,
                stream,
                entries,
                logged.pop(reply_id, 0),
                trim=trim,
                expire=expire,
                ending=ending,
                meta_key=meta,
                live_key=key(reply_id, ":live"),
            )
            continue
        due = expire_due.get(reply_id)
        if due is None:  # the stream's first write makes it: from now on it expires
            expire = (stream,)
            expire_due[reply_id] = now + refresh_s
        elif now >= due:  # a reply that lives long keeps its keys
            expire = (stream, key(reply_id, ":meta"))
            expire_due[reply_id] = now + refresh_s
        else:
            expire = ()
        logged[reply_id] = batch.reply(
            reply_id, stream, entries, logged.get(reply_id, 0), trim=trim, expire=expire
        )
    return groups
