"""``replystream kv`` against what our own engine allocates: its paged pool's real arrays.

For the embedded tiny model and SmolLM2-135M (the installed GGUF's shape), a pool of known
blocks is allocated, sequences of one length are reserved in it until it is full, and ``kv``
is asked about the same shape (float32, the engine's cache), block size and memory.
"""

from __future__ import annotations

import json

import pytest

from replystream.cli import main
from replystream.engine.gguf_file import open_gguf
from replystream.engine.kv_cache import OutOfBlocks, PagedKVCache
from replystream.engine.model import ModelConfig
from replystream.engine.tiny import ASSETS
from replystream.lab.kvcalc import PRESETS
from tests.services import require_smollm2


def tiny_shape() -> ModelConfig:
    return ModelConfig.from_json(ASSETS / "config.json")


def smollm2_shape() -> ModelConfig:
    return open_gguf(require_smollm2()).config


SHAPES = {"tiny": tiny_shape, "smollm2": smollm2_shape}

# (tokens per sequence, block size, blocks in the pool): whole blocks, a last block partly
# empty, a block larger than a sequence's remainder, single-token blocks.
POOLS = [(128, 16, 64), (100, 16, 64), (100, 64, 16), (1000, 16, 200), (37, 1, 100)]


def fill(cache: PagedKVCache, tokens: int) -> tuple[int, int]:
    """Sequences of ``tokens`` the pool holds at once, and the bytes the first one holds."""
    allocator = cache.allocator
    allocator.reserve(0, tokens)
    held = allocator.stats().used_blocks * cache.block_size * allocator.bytes_per_token
    count = 1
    while True:
        try:
            allocator.reserve(count, tokens)
        except OutOfBlocks:
            return count, held
        count += 1


@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize(("tokens", "block_size", "blocks"), POOLS)
def test_kv_with_a_block_size_matches_the_engines_paged_pool(
    capsys, model, tokens, block_size, blocks
):
    shape = SHAPES[model]()
    cache = PagedKVCache(
        shape.n_layers, shape.n_kv_heads, shape.head_dim, blocks, block_size=block_size
    )
    fits, held = fill(cache, tokens)
    memory_gib = cache.pool_bytes / 2**30  # a binary fraction: exact as a decimal too
    args = ["kv", "--layers", str(shape.n_layers), "--kv-heads", str(shape.n_kv_heads)]
    args += ["--head-dim", str(shape.head_dim), "--tokens", str(tokens), "--dtype", "fp32"]
    args += ["--block-size", str(block_size), "--memory-gib", repr(memory_gib), "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bytes_per_token"] == cache.allocator.bytes_per_token
    assert result["bytes_per_sequence"] == held
    assert result["blocks_per_sequence"] == -(-tokens // block_size)
    assert result["blocks_that_fit"] == blocks
    assert result["sequences_that_fit"] == fits
    assert result["tokens_that_fit"] == blocks * block_size


@pytest.mark.parametrize("model", SHAPES)
def test_kv_without_blocks_is_the_pools_bytes_for_whole_blocks(capsys, model):
    # The article's formula, no blocks: exact whenever a sequence fills its blocks.
    shape = SHAPES[model]()
    cache = PagedKVCache(shape.n_layers, shape.n_kv_heads, shape.head_dim, 8, block_size=16)
    args = ["kv", "--layers", str(shape.n_layers), "--kv-heads", str(shape.n_kv_heads)]
    args += ["--head-dim", str(shape.head_dim), "--tokens", "128", "--dtype", "fp32", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_sequence"] == cache.pool_bytes


def test_a_window_may_touch_one_block_more_than_it_fills(capsys):
    # 4,096 positions starting mid-block span 257 blocks of 16.
    args = ["kv", "--model", "mistral-7b-v0.1", "--block-size", "16", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["blocks_per_sequence"] == 257
    assert result["bytes_per_sequence"] == 257 * 16 * 131_072
    # Shorter than its window, a sequence takes only the blocks its tokens fill.
    assert main([*args[:-1], "--tokens", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks_per_sequence"] == 7


def test_a_decode_step_reads_the_cached_tokens_not_the_empty_slots(capsys):
    shape = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "100"]
    step = ["--weights-gb", "16", "--bandwidth-tbs", "2", "--batch", "4"]
    assert main(["kv", *shape, *step, "--block-size", "64", "--json"]) == 0
    blocked = json.loads(capsys.readouterr().out)
    assert blocked["bytes_per_sequence"] == 128 * 131_072  # two blocks of 64 held
    assert blocked["decode_step"]["batch_cache_bytes"] == 4 * 100 * 131_072  # 100 read
    assert main(["kv", *shape, *step, "--block-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "100 tokens in 2 blocks of 64 = 16,777,216 B = 16 MiB" in out
    assert "4 x 12.50 MiB cached" in out


def test_a_bad_block_size_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["kv", "--model", "llama-3-8b", "--block-size", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--block-size" in err


def test_the_smollm2_preset_is_the_installed_models_shape():
    shape, preset = smollm2_shape(), PRESETS["smollm2-135m"]
    assert (preset.layers, preset.kv_heads, preset.head_dim, preset.context) == (
        shape.n_layers,
        shape.n_kv_heads,
        shape.head_dim,
        shape.context,
    )
