"""A GGUF file the engine cannot run is refused at load, in one line naming the file.

Each test writes its own small llama GGUF (``tests/gguf_files.py``) with one thing wrong: a
claim the file's tensors contradict, a value the model cannot compute with, a tensor or a
scaling the engine does not implement, damaged weights or layout. Nothing may be allocated in
proportion to what the metadata merely claims.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np

from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.gguf_engine import load_gguf_engine, load_gguf_model
from replystream.engine.model import ROTARY_ROWS
from tests.gguf_files import write_llama_gguf


def peak_bytes_of_loading(path: Path) -> int:
    tracemalloc.start()
    try:
        load_gguf_model(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_claimed_context_of_2_to_the_40_costs_no_memory_until_positions_are_run(
    tmp_path: Path,
) -> None:
    small = write_llama_gguf(tmp_path / "small.gguf")
    huge = write_llama_gguf(tmp_path / "huge.gguf", meta={"context_length": 2**40})
    assert peak_bytes_of_loading(huge) < peak_bytes_of_loading(small) + 2**20


async def test_a_model_claiming_a_huge_context_still_answers(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "huge.gguf", meta={"context_length": 2**40})
    engine, _ = load_gguf_engine(path)
    request = GenerationRequest("the", sampling=SamplingParams(max_tokens=4, temperature=0.0))
    stream = await engine.start(request)
    deltas = [d async for d in stream]
    assert deltas[-1].finish_reason is not None


def test_rotary_rows_past_the_first_table_are_those_a_whole_table_gives(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "long.gguf", meta={"context_length": 4 * ROTARY_ROWS})
    _, model, _ = load_gguf_model(path)
    pos = np.array([0, 7, ROTARY_ROWS + 5, 3 * ROTARY_ROWS], dtype=np.int64)
    cos, sin = model._rotation(pos)
    d = model.config.head_dim
    inv_freq = 1.0 / model.config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.outer(np.arange(4 * ROTARY_ROWS), inv_freq)
    angles = np.concatenate((angles, angles), axis=-1)[pos]
    assert np.array_equal(cos[:, 0], np.cos(angles).astype(np.float32))
    assert np.array_equal(sin[:, 0], np.sin(angles).astype(np.float32))
    assert len(model._rotary[0]) < 4 * ROTARY_ROWS + 1
