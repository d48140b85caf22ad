"""The paged KV cache: block accounting, waste, and reads equal to a contiguous cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from replystream.engine.kv_cache import (
    BlockAllocator,
    ContiguousKVCache,
    OutOfBlocks,
    PagedKVCache,
)
from replystream.engine.model import KVStep, ModelConfig
from replystream.engine.tiny import ASSETS
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.lab.kvcalc import format_bytes


def test_reserve_grows_by_whole_blocks_and_free_returns_them() -> None:
    a = BlockAllocator(num_blocks=6, block_size=16, bytes_per_token=100)
    a.reserve(1, 17)
    a.reserve(2, 16)
    assert len(a.table(1)) == 2 and len(a.table(2)) == 1
    stats = a.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.live_tokens) == (3, 3, 33)
    assert stats.wasted_tokens == 15  # sequence 1's second block holds 1 of 16
    assert stats.wasted_bytes == 1500
    assert stats.wasted_fraction == pytest.approx(15 / 48)
    assert a.free(1) == 2
    assert a.stats().used_blocks == 1 and 1 not in a


def test_reserve_that_does_not_fit_changes_nothing() -> None:
    a = BlockAllocator(num_blocks=2, block_size=4)
    a.reserve(1, 4)
    with pytest.raises(OutOfBlocks):
        a.reserve(2, 9)
    assert a.table(2) == () and a.free_blocks == 1


def test_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    cache = PagedKVCache(n_layers=4, kv_heads=2, head_dim=32, num_blocks=8, block_size=16)
    assert cache.allocator.bytes_per_token == 2 * 4 * 2 * 32 * 4  # K and V, float32
    assert cache.pool_bytes == 8 * 16 * cache.allocator.bytes_per_token


def test_paged_cache_reads_what_a_contiguous_cache_reads() -> None:
    rng = np.random.default_rng(0)
    paged = PagedKVCache(n_layers=2, kv_heads=2, head_dim=8, num_blocks=32, block_size=4)
    flat = ContiguousKVCache(n_layers=2, kv_heads=2, head_dim=8, context=64)
    lengths = {0: 0, 1: 0, 2: 0}
    for _ in range(40):  # interleaved appends of random sizes, as a batch would make
        seq = int(rng.integers(3))
        n = int(rng.integers(1, 6))
        start = lengths[seq]
        paged.allocator.reserve(seq, start + n)
        for layer in range(2):
            k = rng.standard_normal((n, 2, 8)).astype(np.float32)
            v = rng.standard_normal((n, 2, 8)).astype(np.float32)
            paged.write(layer, seq, start, k, v)
            flat.write(layer, seq, start, k, v)
        lengths[seq] = start + n
    interleaved = [b for seq in lengths for b in paged.allocator.table(seq)]
    assert interleaved != sorted(interleaved)  # the sequences' blocks are not contiguous
    for seq, length in lengths.items():
        for layer in range(2):
            pk, pv = paged.read(layer, seq, length)
            ck, cv = flat.read(layer, seq, length)
            np.testing.assert_array_equal(pk, ck)
            np.testing.assert_array_equal(pv, cv)


def test_write_past_the_reserved_blocks_is_refused() -> None:
    cache = PagedKVCache(n_layers=1, kv_heads=1, head_dim=2, num_blocks=4, block_size=4)
    cache.allocator.reserve(0, 4)
    with pytest.raises(OutOfBlocks):
        cache.write(0, 0, 3, np.zeros((2, 1, 2), np.float32), np.zeros((2, 1, 2), np.float32))


def test_a_step_writes_every_chunk_and_reads_groups_padded_as_a_contiguous_cache_does() -> None:
    rng = np.random.default_rng(1)
    paged = PagedKVCache(n_layers=2, kv_heads=2, head_dim=4, num_blocks=16, block_size=4)
    flat = ContiguousKVCache(n_layers=2, kv_heads=2, head_dim=4, context=32)
    lengths = [0, 0, 0]
    for _ in range(6):  # steps mixing several-token chunks and one-token chunks
        counts = [int(n) for n in rng.integers(1, 4, 3)]
        spans = [(s, lengths[s], counts[s]) for s in range(3)]
        for s, start, n in spans:
            paged.allocator.reserve(s, start + n)
        groups = [[0, 2], [1]]
        steps: list[KVStep] = [paged.step(spans, groups), flat.step(spans, groups)]
        for layer in range(2):
            k = rng.standard_normal((sum(counts), 2, 4)).astype(np.float32)
            v = rng.standard_normal((sum(counts), 2, 4)).astype(np.float32)
            for step in steps:
                step.write(layer, k, v)
            for g, group in enumerate(groups):
                (pk, pv), (ck, cv) = (step.read(layer, g) for step in steps)
                longest = max(lengths[s] + counts[s] for s in group)
                assert pk.shape == ck.shape == (len(group), longest, 2, 4)
                for row, s in enumerate(group):  # padding differs, positions must not
                    seen = lengths[s] + counts[s]
                    np.testing.assert_array_equal(pk[row, :seen], ck[row, :seen])
                    np.testing.assert_array_equal(pv[row, :seen], cv[row, :seen])
                    assert np.isfinite(pk[row]).all() and np.isfinite(pv[row]).all()
        lengths = [n + c for n, c in zip(lengths, counts, strict=True)]


def test_a_step_past_the_reserved_blocks_is_refused() -> None:
    cache = PagedKVCache(n_layers=1, kv_heads=1, head_dim=2, num_blocks=4, block_size=4)
    cache.allocator.reserve(0, 4)
    with pytest.raises(OutOfBlocks):
        cache.step([(0, 3, 2)], [[0]])


def test_model_doc_states_the_tiny_engines_default_pool_as_allocated() -> None:
    # docs/model.md's table of the two models gives each default pool's size; the tiny
    # engine's is what its default config allocates for the shipped model's shape.
    shape = ModelConfig.from_json(ASSETS / "config.json")
    config = TinyEngineConfig()
    cache = PagedKVCache(
        shape.n_layers, shape.n_kv_heads, shape.head_dim, config.num_blocks, config.block_size
    )
    tokens = config.num_blocks * config.block_size
    doc = Path(__file__).resolve().parent.parent / "docs" / "model.md"
    row = next(line for line in doc.read_text().splitlines() if line.startswith("| default pool"))
    tiny = row.rstrip(" |").rsplit("|", 1)[1].strip()
    assert tiny.startswith(
        f"{config.num_blocks} blocks of {config.block_size} = {tokens:,} tokens, "
        f"{format_bytes(cache.pool_bytes)}:"
    )
