"""How the Redis reply log names a reply's keys, and which call each key goes in.

Every key of a reply holds its id in braces, a Redis Cluster hash tag, so all of a reply's
keys share one hash slot and one shard (``P`` is the prefix): ``P{id}`` (the stream),
``P{id}:meta``, ``P{id}:live``, ``P{id}:cancel`` and ``P{id}:read``. A Cluster runs a script
on the keys of one slot only, so against one (``one_slot_per_call``) every call is grouped by
slot; otherwise every key is in group 0. Each store also counts its own calls in Redis
(``counter_key``: one count per group), which is how a failover that lost acknowledged
writes is found. This file names keys; it sends no command.
"""

from __future__ import annotations

import uuid

from redis.crc import key_slot

from replystream.delivery.redis_writes import slot_tag

# The parts a delete removes (``:read`` is a reader's mark, left to expire on its own).
DELETED_PARTS = ("", ":meta", ":live", ":cancel")


class ReplyKeys:
    """The keys of every reply of one store, and of the store's own call counts."""

    def __init__(self, prefix: str, *, one_slot_per_call: bool) -> None:
        self.prefix = prefix
        # A Redis Cluster runs a script only on keys of one hash slot: against one, a flush
        # sends one call per slot (a reply's keys share its slot) instead of one for all.
        self.one_slot_per_call = one_slot_per_call
        self._writer = f"{prefix}writer:{uuid.uuid4().hex}"

    def key(self, reply_id: str, part: str = "") -> str:
        """The key of one part of a reply (``""``: its stream; ``":meta"``, ``":live"``...)."""
        # The braces make the id the key's hash tag: one slot for all of a reply's keys.
        return f"{self.prefix}{{{reply_id}}}{part}"

    def slot_of_key(self, key: str) -> int:
        """Which call a key goes in: its hash slot with ``one_slot_per_call``, else 0."""
        return key_slot(key.encode()) if self.one_slot_per_call else 0

    def group(self, reply_id: str) -> int:
        """Which call a reply's keys go in."""
        return self.slot_of_key(self.key(reply_id))

    def counter_key(self, group: int) -> str:
        """The key of this store's count of its calls to ``group``: in that slot, for a
        Cluster (a call touches one slot only)."""
        if not self.one_slot_per_call:
            return self._writer
        return f"{self._writer}:{{{slot_tag(group)}}}"
