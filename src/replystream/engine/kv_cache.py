"""Paged KV cache: fixed-size blocks in one preallocated pool, a block table per sequence.

This file decides where a sequence's keys and values live. ``BlockAllocator`` is the
bookkeeping alone (free list, block tables, reference counts, token counts; no arrays), so the
scheduler can plan with it and be tested without a model. ``PagedKVCache`` adds the pool
itself: per layer one (num_blocks, block_size, kv heads, head dim) array for K and one for V,
allocated once, and never more than the machine's memory. A sequence's blocks return to the
pool the moment ``free`` is called (finished, cancelled or preempted); with prefix caching,
the full ones stay findable by later sequences that begin with the same tokens, which then
share them (``prefix_cache``). ``ContiguousKVCache`` keeps each sequence in one contiguous array; it
is the reference the paged cache is tested against. Both also answer a whole forward pass at
once (``step``): the slots of every new token and the padded gather of every sequence a group
attends over are worked out once, then each layer is one indexed write and one indexed read
per group, with no loop over sequences. This file must not know about models, requests or time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from replystream.engine.prefix_cache import ROOT, PrefixCache, block_digests

F32 = NDArray[np.float32]
I64 = NDArray[np.int64]
Span = tuple[int, int, int]  # (seq_id, first new position, new tokens) of one chunk of a step


class OutOfBlocks(Exception):
    """The pool has too few free blocks for the requested growth."""


class PoolTooLarge(ValueError):
    """A pool of ``num_blocks`` blocks would not fit in this machine's memory."""

    def __init__(self, num_blocks: int, pool_bytes: int, memory_bytes: int | None) -> None:
        has = f"this machine's {memory_bytes / 2**30:,.1f} GiB" if memory_bytes else "memory"
        super().__init__(
            f"a KV pool of {num_blocks:,} blocks takes {pool_bytes / 2**30:,.1f} GiB, "
            f"more than {has}"
        )
        self.num_blocks = num_blocks


def physical_memory_bytes() -> int | None:
    """This machine's memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Occupancy of the block pool.

    Attributes:
        wasted_tokens: slots reserved in sequences' last, partly filled blocks but unused.
        wasted_bytes: ``wasted_tokens`` times the K and V bytes of one token (all layers).
    """

    block_size: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    sequences: int
    live_tokens: int
    wasted_tokens: int
    bytes_per_token: int
    wasted_bytes: int
    cached_blocks: int = 0  # of the free blocks, those keeping a prefix for later requests

    @property
    def live_bytes(self) -> int:
        return self.live_tokens * self.bytes_per_token

    @property
    def wasted_fraction(self) -> float:
        """Share of the reserved slots that hold no token (0 when nothing is reserved)."""
        reserved = self.used_blocks * self.block_size
        return self.wasted_tokens / reserved if reserved else 0.0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached blocks a sequence's tokens begin with, and the digest of the last."""

    blocks: tuple[int, ...] = ()
    digest: bytes = ROOT


NO_MATCH = PrefixMatch()


class BlockAllocator:
    """Free list and block tables of a pool of ``num_blocks`` blocks of ``block_size`` tokens.

    A block is held by every sequence whose table has it (a reference count). With
    ``prefix_caching`` a full block is named by its tokens and everything before them
    (``prefix_cache``), another sequence beginning with those tokens takes it into its own
    table instead of computing it again (``match``, ``adopt``), and a named block nobody holds
    stays cached, as free as an unnamed one, until a block is needed and none of those is left.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        bytes_per_token: int = 0,
        *,
        prefix_caching: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._refs = [0] * num_blocks
        self._shared = 0  # references past each block's first: tables that share blocks
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._prefix = PrefixCache() if prefix_caching else None
        self._named: dict[int, tuple[int, bytes]] = {}  # per sequence: blocks named, last digest

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free) + (self._prefix.idle if self._prefix is not None else 0)

    @property
    def caches_prefixes(self) -> bool:
        """Whether a sequence may begin with blocks cached for an earlier one (``match``)."""
        return self._prefix is not None

    def blocks_needed(self, seq_id: int, length: int) -> int:
        """Extra blocks ``seq_id`` needs to hold ``length`` tokens."""
        return max(0, self.blocks_for(length) - len(self._tables.get(seq_id, ())))

    def can_hold(self, seq_id: int, length: int) -> bool:
        return self.blocks_needed(seq_id, length) <= self.free_blocks

    def reserve(self, seq_id: int, length: int) -> None:
        """Grow ``seq_id``'s table to hold ``length`` tokens (never shrinks).

        Raises:
            OutOfBlocks: fewer free blocks than needed; nothing is changed.
        """
        need = self.blocks_needed(seq_id, length)
        if need > self.free_blocks:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} blocks, {self.free_blocks} free")
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(need))
        self._lengths[seq_id] = max(self._lengths.get(seq_id, 0), length)

    def _take(self) -> int:
        # An unnamed free block first: a named one may still save a later request's prefill.
        block = self._free.pop() if self._free else self._prefix_cache().evict()
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            self._shared -= 1
        elif self._prefix is not None and self._prefix.named(block):
            self._prefix.park(block)
        else:
            self._free.append(block)

    def _prefix_cache(self) -> PrefixCache:
        if self._prefix is None:
            raise OutOfBlocks("no free block")
        return self._prefix

    def truncate(self, seq_id: int, length: int) -> int:
        """Keep only ``length`` tokens of ``seq_id`` (rejected draft positions roll back);
        blocks past them go back to the pool. How many blocks were freed."""
        table = self._tables.get(seq_id)
        if table is None or length >= self._lengths[seq_id]:
            return 0
        keep = self.blocks_for(length)
        freed = table[keep:]
        del table[keep:]
        for block in reversed(freed):
            self._release(block)
        self._lengths[seq_id] = length
        if self._named.get(seq_id, (0, ROOT))[0] > keep:  # named blocks are computed ones, so
            self._named.pop(seq_id)  # never cut; were one, naming starts over from the first
        return len(freed)

    def free(self, seq_id: int) -> int:
        """Return every block of ``seq_id`` to the pool; how many were freed (0 if none).

        Its last blocks are released first, so its first ones, the likeliest to begin another
        request, are the last a cache gives up."""
        table = self._tables.pop(seq_id, [])
        self._lengths.pop(seq_id, None)
        self._named.pop(seq_id, None)
        for block in reversed(table):
            self._release(block)
        return len(table)

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest run of cached blocks ``tokens`` begins with (none without prefix
        caching). The last token is never matched: its position must be computed, for the
        logits the next token is sampled from."""
        if self._prefix is None:
            return NO_MATCH
        blocks: list[int] = []
        last = ROOT
        for digest in block_digests(tokens[: len(tokens) - 1], self.block_size):
            block = self._prefix.lookup(digest)
            if block is None:
                break
            blocks.append(block)
            last = digest
        return PrefixMatch(tuple(blocks), last)

    def idle_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are cached and held by nobody: adopting them takes them
        out of the free blocks."""
        prefix = self._prefix
        return 0 if prefix is None else sum(1 for b in blocks if prefix.is_idle(b))

    def adopt(self, seq_id: int, match: PrefixMatch) -> int:
        """Begin ``seq_id``'s table, which must be empty, with the matched blocks; how many
        tokens they hold (computed already)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not match.blocks:
            return 0
        for block in match.blocks:
            if self._refs[block] == 0:
                self._prefix_cache().reclaim(block)
            else:
                self._shared += 1
            self._refs[block] += 1
        self._tables[seq_id] = list(match.blocks)
        tokens = len(match.blocks) * self.block_size
        self._lengths[seq_id] = tokens
        self._named[seq_id] = (len(match.blocks), match.digest)
        return tokens

    def name_full_blocks(self, seq_id: int, tokens: Sequence[int], computed: int) -> None:
        """Name the blocks of ``seq_id`` that the first ``computed`` of its ``tokens`` fill,
        so later requests beginning with them find them (nothing without prefix caching)."""
        prefix = self._prefix
        if prefix is None:
            return
        named, last = self._named.get(seq_id, (0, ROOT))
        full = computed // self.block_size
        if full <= named:
            return
        table = self._tables[seq_id]
        digests = block_digests(tokens[: full * self.block_size], self.block_size, named, last)
        for index, digest in enumerate(digests, named):
            prefix.add(table[index], digest)
            last = digest
        self._named[seq_id] = (full, last)

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))

    def length(self, seq_id: int) -> int:
        return self._lengths.get(seq_id, 0)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def stats(self) -> KVCacheStats:
        cached = self._prefix.idle if self._prefix is not None else 0
        used = self.num_blocks - len(self._free) - cached
        # A shared block's tokens count once: it is full, and held in several tables.
        live = sum(self._lengths.values()) - self._shared * self.block_size
        wasted = used * self.block_size - live
        return KVCacheStats(
            block_size=self.block_size,
            total_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=len(self._free) + cached,
            sequences=len(self._tables),
            live_tokens=live,
            wasted_tokens=wasted,
            bytes_per_token=self.bytes_per_token,
            wasted_bytes=wasted * self.bytes_per_token,
            cached_blocks=cached,
        )


class PagedKVCache:
    """The block pool's K and V arrays, addressed through a ``BlockAllocator``'s tables."""

    def __init__(
        self,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        prefix_caching: bool = False,
    ) -> None:
        """Allocate the pool.

        Raises:
            PoolTooLarge: the pool is more than this machine's memory, or cannot be allocated.
        """
        shape = (n_layers, num_blocks, block_size, kv_heads, head_dim)
        pool_bytes = 2 * n_layers * num_blocks * block_size * kv_heads * head_dim * 4
        # The arrays are zeroed lazily, page by page as sequences write them: a pool past the
        # machine's memory would be allocated now and kill the process later, under load.
        memory = physical_memory_bytes()
        if memory is not None and pool_bytes > memory:
            raise PoolTooLarge(num_blocks, pool_bytes, memory)
        try:
            self._k = np.zeros(shape, np.float32)  # (layers, blocks, block size, heads, head dim)
            self._v = np.zeros(shape, np.float32)
        except MemoryError:
            raise PoolTooLarge(num_blocks, pool_bytes, memory) from None
        # The same memory as (layers, slots, kv heads, head dim): slot = block * size + offset.
        self._k_slots = self._k.reshape(n_layers, num_blocks * block_size, kv_heads, head_dim)
        self._v_slots = self._v.reshape(n_layers, num_blocks * block_size, kv_heads, head_dim)
        bytes_per_token = 2 * n_layers * kv_heads * head_dim * self._k.itemsize
        self.allocator = BlockAllocator(
            num_blocks, block_size, bytes_per_token, prefix_caching=prefix_caching
        )
        self.block_size = block_size

    @property
    def pool_bytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def write(self, layer: int, seq_id: int, start: int, k: F32, v: F32) -> None:
        pos = np.arange(start, start + k.shape[0])  # (T,)
        table = np.asarray(self.allocator.table(seq_id))
        if pos[-1] >= len(table) * self.block_size:
            raise OutOfBlocks(f"sequence {seq_id} has no block reserved for position {pos[-1]}")
        blocks, offsets = table[pos // self.block_size], pos % self.block_size  # (T,), (T,)
        self._k[layer, blocks, offsets] = k  # k: (T, kv heads, head dim)
        self._v[layer, blocks, offsets] = v

    def read(self, layer: int, seq_id: int, length: int) -> tuple[F32, F32]:
        blocks = list(self.allocator.table(seq_id)[: -(-length // self.block_size)])
        KV, D = self._k.shape[3:]
        k = self._k[layer, blocks].reshape(-1, KV, D)[:length]  # (length, kv heads, head dim)
        v = self._v[layer, blocks].reshape(-1, KV, D)[:length]
        return k, v

    def _slots(self, seq_id: int, positions: I64) -> I64:
        """Pool slots of ``seq_id``'s ``positions`` (any shape), through its block table."""
        table = np.asarray(self.allocator.table(seq_id), dtype=np.int64)
        if positions.size and positions.max() >= len(table) * self.block_size:
            raise OutOfBlocks(
                f"sequence {seq_id} has no block reserved for position {positions.max()}"
            )
        slots: I64 = table[positions // self.block_size] * self.block_size
        return slots + positions % self.block_size

    def step(self, spans: Sequence[Span], groups: Sequence[Sequence[int]]) -> PagedStep:
        """One forward pass's indices, worked out once for every layer.

        Raises:
            OutOfBlocks: a span reaches past its sequence's reserved blocks.
        """
        writes = [self._slots(s, np.arange(start, start + n)) for s, start, n in spans]
        reads = []
        for group in groups:
            lengths = np.array([spans[i][1] + spans[i][2] for i in group], dtype=np.int64)
            positions = np.arange(int(lengths.max()))  # (longest,)
            index = np.zeros((len(group), len(positions)), dtype=np.int64)  # padding: slot 0
            for row, i in enumerate(group):
                index[row, : lengths[row]] = self._slots(spans[i][0], positions[: lengths[row]])
            reads.append(index)
        return PagedStep(self._k_slots, self._v_slots, np.concatenate(writes), reads)

    def stats(self) -> KVCacheStats:
        return self.allocator.stats()


class PagedStep:
    """A forward pass's view of the pool: its new rows' slots and each group's gather."""

    def __init__(self, k_slots: F32, v_slots: F32, writes: I64, reads: list[I64]) -> None:
        self._k, self._v = k_slots, v_slots  # (layers, slots, kv heads, head dim)
        self._writes = writes  # (new rows,) slot of each new token, chunks in order
        self._reads = reads  # per group: (sequences, longest) slots, padding at slot 0

    def write(self, layer: int, k: F32, v: F32) -> None:
        self._k[layer, self._writes] = k  # k, v: (new rows, kv heads, head dim)
        self._v[layer, self._writes] = v

    def read(self, layer: int, group: int) -> tuple[F32, F32]:
        index = self._reads[group]  # (sequences, longest)
        return self._k[layer][index], self._v[layer][index]  # (sequences, longest, KV, D)


class ContiguousKVCache:
    """One (layers, context, kv heads, head dim) array per sequence: the simple reference."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, context: int) -> None:
        self._shape = (n_layers, context, kv_heads, head_dim)
        self.token_shape = (kv_heads, head_dim)  # one token's K (or V) in one layer
        self._k: dict[int, F32] = {}
        self._v: dict[int, F32] = {}

    def write(self, layer: int, seq_id: int, start: int, k: F32, v: F32) -> None:
        if seq_id not in self._k:
            self._k[seq_id] = np.zeros(self._shape, np.float32)
            self._v[seq_id] = np.zeros(self._shape, np.float32)
        self._k[seq_id][layer, start : start + k.shape[0]] = k
        self._v[seq_id][layer, start : start + v.shape[0]] = v

    def read(self, layer: int, seq_id: int, length: int) -> tuple[F32, F32]:
        return self._k[seq_id][layer, :length], self._v[seq_id][layer, :length]

    def free(self, seq_id: int) -> None:
        self._k.pop(seq_id, None)
        self._v.pop(seq_id, None)

    def step(self, spans: Sequence[Span], groups: Sequence[Sequence[int]]) -> ContiguousStep:
        """The same contract as ``PagedKVCache.step``, sequence by sequence (the reference)."""
        return ContiguousStep(self, spans, groups)


class ContiguousStep:
    """A forward pass over a ``ContiguousKVCache``: loops over sequences, zero padding."""

    def __init__(
        self, cache: ContiguousKVCache, spans: Sequence[Span], groups: Sequence[Sequence[int]]
    ) -> None:
        self._cache, self._spans, self._groups = cache, list(spans), [list(g) for g in groups]

    def write(self, layer: int, k: F32, v: F32) -> None:
        row = 0
        for seq_id, start, n in self._spans:
            self._cache.write(layer, seq_id, start, k[row : row + n], v[row : row + n])
            row += n

    def read(self, layer: int, group: int) -> tuple[F32, F32]:
        spans = [self._spans[i] for i in self._groups[group]]
        longest = max(start + n for _, start, n in spans)
        shape = (len(spans), longest, *self._cache.token_shape)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        for row, (seq_id, start, n) in enumerate(spans):
            k[row, : start + n], v[row, : start + n] = self._cache.read(layer, seq_id, start + n)
        return k, v
