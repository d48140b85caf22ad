"""The NumPy transformer: cached decode, batching and paging change no logit.

Tolerance: float32 throughout; cached and recomputed logits agree to ``atol=2e-4`` (logits are
of order 10, so this is about 1e-5 relative). Paged against contiguous storage is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from replystream.engine import model as model_module
from replystream.engine.kv_cache import ContiguousKVCache, PagedKVCache
from replystream.engine.model import Chunk, KVStore, TinyModel, load_safetensors
from replystream.engine.tiny import ASSETS
from replystream.engine.tokenizer import ByteTokenizer

ATOL = 2e-4

TEXTS = [
    "In the beginning was the Word, and the Word was with God.",
    "And he said unto them, Go ye into all the world",
    "Blessed are the meek: for they shall inherit the earth. Blessed are they",
    "Then",
]


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel.load(ASSETS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = ByteTokenizer(ASSETS / "tokenizer.json")
    return [tokenizer.encode(t) for t in TEXTS]


def paged(model: TinyModel, blocks: int = 64, block_size: int = 16) -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, blocks, block_size)


def reserve(cache: KVStore, seq_id: int, length: int) -> None:
    if isinstance(cache, PagedKVCache):
        cache.allocator.reserve(seq_id, length)


def prefill(model: TinyModel, cache: KVStore, seq_id: int, tokens: list[int]) -> np.ndarray:
    reserve(cache, seq_id, len(tokens))
    logits: np.ndarray = model.prefill(seq_id, tokens, cache)
    return logits


def test_decode_with_the_kv_cache_equals_a_full_recompute(
    model: TinyModel, prompts: list[list[int]]
) -> None:
    tokens = prompts[0] + prompts[1]
    full = model.full_logits(tokens)  # (T, vocab), no cache
    cache = paged(model)
    got = [prefill(model, cache, 0, tokens[:5])]
    for pos in range(5, len(tokens)):
        reserve(cache, 0, pos + 1)
        got.append(model.decode([Chunk(0, (tokens[pos],), pos)], cache)[0])
    np.testing.assert_allclose(np.stack(got), full[4:], atol=ATOL, rtol=0)


def test_prefill_logits_equal_a_full_recompute(model: TinyModel, prompts: list[list[int]]) -> None:
    tokens = prompts[2]
    last = prefill(model, paged(model), 0, tokens)
    np.testing.assert_allclose(last, model.full_logits(tokens)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_equals_one_pass(model: TinyModel, prompts: list[list[int]]) -> None:
    tokens = prompts[0] + prompts[2]
    cache = paged(model)
    for start in range(0, len(tokens), 7):  # chunks of 7 across 16-token block edges
        piece = tokens[start : start + 7]
        reserve(cache, 0, start + len(piece))
        logits = model.forward([Chunk(0, tuple(piece), start)], cache)[0]
    np.testing.assert_allclose(logits, model.full_logits(tokens)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("key_block", [1, 5, 16])
def test_prefill_over_many_key_blocks_equals_a_full_recompute(
    model: TinyModel, prompts: list[list[int]], key_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The running max and sum across key blocks (one key each, blocks that end inside a
    chunk, a chunk's queries masked in the last blocks) give the softmax of the whole row."""
    monkeypatch.setattr(model_module, "KEY_BLOCK", key_block)
    tokens = prompts[0] + prompts[2] + prompts[1]
    full = model.full_logits(tokens)
    cache = paged(model)
    for start in range(0, len(tokens), 11):
        piece = tokens[start : start + 11]
        reserve(cache, 0, start + len(piece))
        logits = model.forward([Chunk(0, tuple(piece), start)], cache, [len(piece)])
        np.testing.assert_allclose(logits, full[start : start + len(piece)], atol=ATOL, rtol=0)


def decode_steps(
    model: TinyModel, cache: KVStore, seqs: list[list[int]], steps: int, batched: bool
) -> list[np.ndarray]:
    """Prefill each sequence, then greedy-decode ``steps`` tokens; logits of every step."""
    last = [prefill(model, cache, i, s) for i, s in enumerate(seqs)]
    lengths = [len(s) for s in seqs]
    out = []
    for _ in range(steps):
        chunks = [Chunk(i, (int(np.argmax(last[i])),), lengths[i]) for i in range(len(seqs))]
        for ch in chunks:
            reserve(cache, ch.seq_id, ch.start + 1)
        if batched:
            last = list(model.decode(chunks, cache))
        else:
            last = [model.decode([ch], cache)[0] for ch in chunks]
        lengths = [n + 1 for n in lengths]
        out.append(np.stack(last))
    return out


def test_batched_decode_equals_one_at_a_time(model: TinyModel, prompts: list[list[int]]) -> None:
    together = decode_steps(model, paged(model), prompts, 12, batched=True)
    alone = decode_steps(model, paged(model), prompts, 12, batched=False)
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_a_mixed_step_of_prefill_and_decode_equals_separate_steps(
    model: TinyModel, prompts: list[list[int]]
) -> None:
    cache = paged(model)
    first = prefill(model, cache, 0, prompts[0])
    n = len(prompts[0])
    reserve(cache, 0, n + 1)
    reserve(cache, 1, len(prompts[1]))
    step = [Chunk(0, (int(np.argmax(first)),), n), Chunk(1, tuple(prompts[1]), 0)]
    mixed = model.forward(step, cache)  # (2, vocab)
    ref = paged(model)
    prefill(model, ref, 0, prompts[0])
    reserve(ref, 0, n + 1)
    alone0 = model.forward([step[0]], ref)[0]
    alone1 = prefill(model, ref, 1, prompts[1])
    np.testing.assert_allclose(mixed, np.stack([alone0, alone1]), atol=ATOL, rtol=0)


def test_paged_cache_equals_a_contiguous_one(model: TinyModel, prompts: list[list[int]]) -> None:
    c = model.config
    contiguous = ContiguousKVCache(c.n_layers, c.n_kv_heads, c.head_dim, c.context)
    with_blocks = decode_steps(model, paged(model, block_size=4), prompts, 10, batched=True)
    with_arrays = decode_steps(model, contiguous, prompts, 10, batched=True)
    for a, b in zip(with_blocks, with_arrays, strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_refuses_a_chunk_of_several_tokens(model: TinyModel) -> None:
    with pytest.raises(ValueError, match="one token"):
        model.decode([Chunk(0, (1, 2), 0)], paged(model))


def test_positions_beyond_the_context_are_refused(model: TinyModel) -> None:
    cache = ContiguousKVCache(1, 1, 1, 1)
    with pytest.raises(ValueError, match="context"):
        model.forward([Chunk(0, (1,), model.config.context)], cache)


def test_shipped_model_has_grouped_query_attention_and_a_small_size(model: TinyModel) -> None:
    c = model.config
    assert c.n_kv_heads < c.n_heads
    assert 1_000_000 <= model.parameter_count <= 3_000_000


def test_safetensors_loader_reads_f32_and_f16(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([0.5, -2.0], dtype=np.float16)
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F16", "shape": [2], "data_offsets": [24, 28]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + a.tobytes() + b.tobytes())
    loaded = load_safetensors(path)
    np.testing.assert_array_equal(loaded["a"], a)
    np.testing.assert_array_equal(loaded["b"], b.astype(np.float32))
