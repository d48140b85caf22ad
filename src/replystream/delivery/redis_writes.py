"""The Redis reply log's writes, batched: everything queued goes to Redis in one script call.

A reply's events arrive one at a time, from thousands of replies at once; through redis-py a
command costs the replica more CPU than the event did to produce (packing its arguments and
reading its answer, in Python). So one flush sends one ``EVALSHA`` of ``WRITE_SCRIPT``: the
keys it touches, and one JSON text (encoded by the C encoder, in one call) holding the new
replies, every reply's new entries and its ending; Redis runs the ``XADD``s. Per event the
replica builds one row; per reply and flush, one key. Expiry and trimming are not per event
either: a stream's TTL is set on its first write, refreshed every third of the TTL while the reply
lives and at its end, and ``MAXLEN`` is asked for only once a reply has more entries than
are kept. A write that fails fails its reply alone (the others in the batch go on).

The liveness refresh is one call too (``HEARTBEAT_SCRIPT``). This file knows the stream
entries' fields but not the keys' names (the store passes every key).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from replystream.delivery.replay import LogEntry

# ARGV[1]: JSON [ttl, liveness, creates, replies], flat where it can be (the encoder's cost is
# per list as much as per value).
#   creates: [meta key index, live key index, owner, context]
#   replies: [stream key index, trim to (0: no trim), indices of keys to expire, ending
#             ([seq, text]) or null, live key index to delete (0: none), then 4 values per
#             entry: seq, type ("": none), data, log size]
# Returns the replies whose writes failed: {index, error, index, error, ...} (from 0).
WRITE_SCRIPT = """
local batch = cjson.decode(ARGV[1])
local ttl, liveness = batch[1], batch[2]
for _, c in ipairs(batch[3]) do
  redis.call('HSET', KEYS[c[1]], 'owner', c[3], 'context', c[4])
  redis.call('EXPIRE', KEYS[c[1]], ttl)
  redis.call('SET', KEYS[c[2]], '1', 'EX', liveness)
end
local failed = {}
for i, r in ipairs(batch[4]) do
  local key, trim, err = KEYS[r[1]], r[2], nil
  for j = 6, #r, 4 do
    local id = '0-' .. r[j]
    local res
    if trim > 0 then
      res = redis.pcall('XADD', key, 'MAXLEN', '~', trim, id, 'e', r[j + 1], 'd', r[j + 2],
        'b', r[j + 3])
    else
      res = redis.pcall('XADD', key, id, 'e', r[j + 1], 'd', r[j + 2], 'b', r[j + 3])
    end
    if type(res) == 'table' and res.err then
      err = res.err
      break
    end
  end
  if err == nil and r[4] ~= cjson.null then
    local res = redis.pcall('XADD', key, '0-' .. r[4][1], 'end', r[4][2])
    if type(res) == 'table' and res.err then err = res.err end
  end
  if err == nil then
    for _, k in ipairs(r[3]) do redis.call('EXPIRE', KEYS[k], ttl) end
    if r[5] > 0 then redis.call('DEL', KEYS[r[5]]) end
  else
    failed[#failed + 1] = i - 1
    failed[#failed + 1] = err
  end
end
return failed
"""

# KEYS: live key, cancel key, live key, cancel key, ...; ARGV[1]: liveness in seconds.
# Returns, per reply, 1 if a cancel was requested, else 0.
HEARTBEAT_SCRIPT = """
local cancelled = {}
for i = 1, #KEYS, 2 do
  redis.call('SET', KEYS[i], '1', 'EX', ARGV[1])
  cancelled[#cancelled + 1] = redis.call('EXISTS', KEYS[i + 1])
end
return cancelled
"""


# One reply's record: stream key index, trim, keys to expire, ending, live key index, then
# 4 values per entry.
ReplyWrite = list[int | str | list[int] | tuple[int, str] | None]
# Compact, and no check for cycles: the batch is built here from flat values.
_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))


class WriteBatch:
    """One flush's writes, laid out for ``WRITE_SCRIPT``."""

    __slots__ = ("_creates", "_replies", "keys", "reply_ids")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.reply_ids: list[str] = []  # in the order of the script's replies
        self._creates: list[tuple[int, int, str, str]] = []
        self._replies: list[ReplyWrite] = []

    def _index(self, key: str) -> int:
        self.keys.append(key)
        return len(self.keys)  # Lua counts from 1

    def create(self, meta_key: str, live_key: str, owner: str, context: str) -> None:
        self._creates.append((self._index(meta_key), self._index(live_key), owner, context))

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
        live_key: str | None = None,
    ) -> int:
        """Queue ``entries`` (and the ending, if any) of one reply, whose log held ``logged``
        bytes before them; return the log's size after them."""
        stream = self._index(stream_key)
        expired = [stream if key == stream_key else self._index(key) for key in expire]
        live = self._index(live_key) if live_key is not None else 0
        record: ReplyWrite = [stream, trim, expired, ending, live]
        for entry in entries:
            logged += len(entry.data)
            # Each entry carries the log's size up to and including it, so a reader on any
            # replica can tell how far behind it is.
            record += (entry.seq, entry.event or "", entry.data, logged)
        self.reply_ids.append(reply_id)
        self._replies.append(record)
        return logged

    def __bool__(self) -> bool:
        return bool(self._creates or self._replies)

    def argument(self, ttl: int, liveness: int) -> str:
        """The script's one argument (raw UTF-8: Lua's cjson keeps it byte for byte)."""
        return _ENCODER.encode([ttl, liveness, self._creates, self._replies])
