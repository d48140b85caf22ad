"""Automatic prefix caching: full KV blocks kept under a digest of every token up to their end.

A chat's next turn resends the whole conversation, and requests share system prompts; their
first blocks hold the same keys and values. This file decides which blocks can be found again
and which are given up first:
1. A block is named by a chained SHA-256 (``block_digests``): its tokens and the digest of the
   block before it, so one digest stands for every token from the start. A cryptographic hash,
   because a collision would hand one request another's keys and values (another client's
   prompt); a tuple's ``hash`` can be collided on purpose.
2. Only full blocks, whose every position is computed, are named (``add``); a block is never
   written again once full, so sequences that share it only read it.
3. A named block no sequence holds stays cached (``park``), and is given up least recently
   used first (``evict``) when a block is needed and no unnamed one is free.
The reference counts and the block tables are the allocator's (``kv_cache.BlockAllocator``).
This file must not know about sequences, models or time.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

ROOT = b""  # the digest before a sequence's first block


def block_digests(
    tokens: Sequence[int], block_size: int, start: int = 0, parent: bytes = ROOT
) -> Iterator[bytes]:
    """The digest of each full block of ``tokens`` from block ``start`` on, chained from
    ``parent`` (the digest of block ``start - 1``)."""
    for begin in range(start * block_size, len(tokens) - block_size + 1, block_size):
        block = np.asarray(tokens[begin : begin + block_size], np.int64).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        yield parent


class PrefixCache:
    """Which block holds the full block named by each digest, and the named blocks no
    sequence holds, least recently used first."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def add(self, block: int, digest: bytes) -> None:
        """Name a full block; a digest another block already holds keeps that one (two
        sequences computed the same prefix at once: the second's copy stays unnamed)."""
        if digest not in self._block_of and block not in self._digest_of:
            self._block_of[digest] = block
            self._digest_of[block] = digest

    def named(self, block: int) -> bool:
        return block in self._digest_of

    def park(self, block: int) -> None:
        """A named block no sequence holds any more: kept, as the most recently used."""
        self._idle[block] = None

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def reclaim(self, block: int) -> None:
        """A sequence takes an idle named block back."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block and hand it out.

        Raises:
            KeyError: no block is idle.
        """
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._digest_of.pop(block)]
        return block

    @property
    def idle(self) -> int:
        return len(self._idle)
