"""A GGUF file the engine cannot run is refused at load, in one line naming the file.

Each test writes its own small llama GGUF (``tests/gguf_files.py``) with one thing wrong: a
claim the file's tensors contradict, a value the model cannot compute with, a tensor or a
scaling the engine does not implement, damaged weights or layout. Nothing may be allocated in
proportion to what the metadata merely claims.
"""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.gguf_engine import load_gguf_engine, load_gguf_model
from replystream.engine.model import ROTARY_ROWS
from tests.gguf_files import TOKEN_TYPES, write_llama_gguf


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


def with_long_array(path: Path, key: str, count: int) -> Path:
    """``path`` (a sound file) with ``count`` int32s under ``key``, written in place of a
    one-item array (``GGUFWriter`` packs an array one item at a time: far too slow here)."""
    assert (count - 1) * 4 % 32 == 0  # the tensors stay at the same alignment
    write_llama_gguf(path, meta={key: [7]})
    name = struct.pack("<Q", len(key)) + key.encode()
    one = name + struct.pack("<IIQi", 9, 5, 1, 7)  # an array (9) of 1 int32 (5): 7
    many = name + struct.pack("<IIQ", 9, 5, count) + np.arange(count, dtype="<i4").tobytes()
    data = path.read_bytes()
    assert data.count(one) == 1
    path.write_bytes(data.replace(one, many))
    return path


def test_a_long_array_no_one_reads_costs_no_memory_to_load(tmp_path: Path) -> None:
    """4 million numbers (16 MB of file) held as a list were 150 MB of Python ints: an 80 MB
    file took the server to 900 MB. The array is left in the file, unread."""
    small = write_llama_gguf(tmp_path / "small.gguf")
    long = with_long_array(tmp_path / "long.gguf", "general.unused", 4_000_001)
    assert peak_bytes_of_loading(long) < peak_bytes_of_loading(small) + 2**20


def test_the_token_types_kept_are_an_array_of_the_loaders_own(tmp_path: Path) -> None:
    """Not a view of the file, which a file cut short while serving would make a SIGBUS."""
    gguf, _, tokenizer = load_gguf_model(write_llama_gguf(tmp_path / "model.gguf"))
    types = gguf.vocabulary.token_types
    assert isinstance(types, np.ndarray) and types.base is None
    assert types.tolist() == TOKEN_TYPES
    assert tokenizer.decode(tokenizer.encode("<|im_start|>hi")) == "hi"  # a control token


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


def shaped(*shape: int) -> np.ndarray:
    return np.full(shape, 0.01, np.float32)


# (what is changed, the metadata and tensors that change it, what the refusal must say)
REFUSED: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    # The block count checked against the blk.N tensors present.
    ("more blocks claimed", {"block_count": 10**9}, {}, "block_count is 1000000000 but .* 0 to 1"),
    ("a block missing", {"block_count": 3}, {}, "block_count is 3 but"),
    (
        "no block at all",
        {},
        {
            f"blk.{i}.{n}": None
            for i in (0, 1)
            for n in (
                "attn_norm.weight",
                "attn_q.weight",
                "attn_k.weight",
                "attn_v.weight",
                "attn_output.weight",
                "ffn_norm.weight",
                "ffn_gate.weight",
                "ffn_up.weight",
                "ffn_down.weight",
            )
        },
        "no blk.N tensors",
    ),
    # Every tensor's shape checked against the metadata.
    (
        "a projection misshapen",
        {},
        {"blk.0.ffn_up.weight": shaped(32, 32)},
        "blk.0.ffn_up.weight is 32x32; the metadata makes it 64x32",
    ),
    (
        "fewer embedding rows",
        {},
        {"token_embd.weight": shaped(100, 32)},
        "token_embd.weight is 100x32",
    ),
    (
        "an output of another width",
        {},
        {"output.weight": shaped(260, 16)},
        "output.weight is 260x16",
    ),
    (
        "embedding_length not the tensors'",
        {"embedding_length": 64},
        {},
        "the metadata makes it .*x64",
    ),
    ("feed_forward_length not the tensors'", {"feed_forward_length": 128}, {}, "makes it 128x32"),
    (
        "KV heads that do not divide the heads",
        {"attention.head_count_kv": 3},
        {},
        "4 attention heads do not share 3 KV heads",
    ),
    (
        "a vocab_size that is not the vocabulary's",
        {"vocab_size": 300},
        {},
        "llama.vocab_size is 300 but the vocabulary has 260",
    ),
    # Metadata missing or unusable.
    ("no head count", {"attention.head_count": None}, {}, "no llama.attention.head_count"),
    ("no block count", {"block_count": None}, {}, "no llama.block_count"),
    ("no context length", {"context_length": None}, {}, "no llama.context_length"),
    (
        "a context of one token",
        {"context_length": 1},
        {},
        "llama.context_length is 1; a prompt and its reply need at least 2",
    ),
    ("zero heads", {"attention.head_count": 0}, {}, "head_count is 0; it must be a whole number"),
    (
        "heads given per layer",
        {"attention.head_count": [4, 4]},
        {},
        "head_count is given per layer",
    ),
    ("a head count in words", {"attention.head_count": "four"}, {}, "head_count is 'four'"),
    (
        "heads that do not divide the width",
        {"attention.head_count": 5},
        {},
        "not a multiple of 5 heads",
    ),
    (
        "an odd head dimension",
        {"attention.head_count": 32, "attention.head_count_kv": 32},
        {},
        "head dimension 1 is odd",
    ),
    ("rope base 0", {"rope.freq_base": 0.0}, {}, "rope.freq_base is 0.0"),
    (
        "a negative epsilon",
        {"attention.layer_norm_rms_epsilon": -1.0},
        {},
        "layer_norm_rms_epsilon is -1.0",
    ),
    (
        "a mixture of experts",
        {"expert_count": 8, "expert_used_count": 2},
        {},
        "a mixture of 8 experts",
    ),
    (
        "no vocabulary",
        {"tokens": None, "token_type": None, "merges": None},
        {},
        "no tokenizer.ggml.tokens",
    ),
    (
        "a BOS past the vocabulary",
        {"bos_token_id": 100000},
        {},
        "bos_token_id is 100000, not one of the 260",
    ),
    ("an EOS past the vocabulary", {"eos_token_id": 260}, {}, "eos_token_id is 260"),
    ("an EOT past the vocabulary", {"tokenizer.ggml.eot_token_id": 999}, {}, "eot_token_id is 999"),
    ("fewer token types than tokens", {"token_type": [1, 1]}, {}, "2 token types for 260 tokens"),
    # Values of another type than the key's.
    ("tokens not an array", {"tokens": 7}, {}, "tokenizer.ggml.tokens is not an array of text"),
    (
        "tokens that are numbers",
        {"tokens": list(range(260))},
        {},
        "tokenizer.ggml.tokens is not an array of text",
    ),
    ("merges not an array", {"merges": 7}, {}, "tokenizer.ggml.merges is not an array of text"),
    (
        "token types not an array",
        {"token_type": 7},
        {},
        "tokenizer.ggml.token_type is not an array of whole numbers",
    ),
    (
        "token types in words",
        {"token_type": ["normal"] * 260},
        {},
        "tokenizer.ggml.token_type is not an array of whole numbers",
    ),
    (
        "a chat template that is a number",
        {"tokenizer.chat_template": 5},
        {},
        "tokenizer.chat_template is not text",
    ),
    (
        "an alignment that is an array",
        {"general.alignment": [32]},
        {},
        "general.alignment is \\[32\\]; it must be a power of two",
    ),
    (
        "a merge of tokens not in the vocabulary",
        {"merges": ["Ġ t", "q z"]},
        {},
        "merge 1 \\('q z'\\) joins tokens",
    ),
    (
        "a missing layer tensor",
        {},
        {"blk.1.ffn_down.weight": None},
        "no tensor blk.1.ffn_down.weight",
    ),
    ("no output norm", {}, {"output_norm.weight": None}, "no tensor output_norm.weight"),
    (
        "an integer tensor",
        {},
        {"blk.0.attn_norm.weight": np.ones(32, np.int32)},
        "blk.0.attn_norm.weight is of kind I32",
    ),
    # Tensors and scalings the engine does not compute.
    (
        "Llama 3.1's rope_freqs",
        {},
        {"rope_freqs.weight": np.ones(4, np.float32)},
        "does not compute: rope_freqs.weight \\(Llama 3.1's rope scaling\\)",
    ),
    (
        "attention biases",
        {},
        {"blk.0.attn_q.bias": shaped(32), "blk.0.attn_k.bias": shaped(16)},
        "does not compute: blk.0.attn_q.bias, blk.0.attn_k.bias \\(biases\\)",
    ),
    (
        "yarn scaling with no factor",
        {"rope.scaling.type": "yarn"},
        {},
        "rope scaling 'yarn' is not supported",
    ),
    (
        "linear scaling",
        {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
        {},
        "rope scaling 'linear'",
    ),
    (
        "a scaling factor that is an array",
        {"rope.scaling.factor": [1.0]},
        {},
        "rope.scaling.factor is \\[1.0\\]; it must be one value",
    ),
    (
        "a vocab_size that is an array",
        {"vocab_size": [260]},
        {},
        "llama.vocab_size is \\[260\\]; it must be one value",
    ),
    (
        "a BOS that is an array",
        {"bos_token_id": [1, 2]},
        {},
        "bos_token_id is \\[1, 2\\], not one of the 260",
    ),
    (
        "a scaling factor alone",
        {"rope.scaling.factor": 8.0},
        {},
        "rope.scaling.factor 8.0 is not supported",
    ),
]


@pytest.mark.parametrize(
    ("meta", "tensors", "message"), [case[1:] for case in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_a_file_the_engine_cannot_run_is_refused_in_one_line_naming_it(
    tmp_path: Path, meta: dict[str, Any], tensors: dict[str, Any], message: str
) -> None:
    path = write_llama_gguf(tmp_path / "model.gguf", meta=meta, tensors=tensors)
    with pytest.raises(ValueError, match=message) as refused:
        load_gguf_engine(path)
    text = str(refused.value)
    assert text.startswith(f"{path}: ") and "\n" not in text, text


def test_a_sound_file_with_its_own_output_and_quantised_weights_loads(tmp_path: Path) -> None:
    path = write_llama_gguf(
        tmp_path / "q8.gguf",
        tensors={"output.weight": shaped(260, 32)},
        kind=GGMLQuantizationType.Q8_0,
    )
    _, model, _ = load_gguf_model(path)
    assert model.unembed is not model.embed


def serve_check(path: Path) -> subprocess.CompletedProcess[str]:
    """``serve --engine gguf:PATH --check`` in at most 3 GiB of address space."""

    def bound() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    argv = [sys.executable, "-m", "replystream", "serve", "--engine", f"gguf:{path}", "--check"]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env=env, preexec_fn=bound
    )


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"block_count": 10**9}, "llama.block_count is 1000000000 but the file has blocks 0 to 1"),
        ({"attention.head_count": None}, "no llama.attention.head_count in the metadata"),
        (
            {"eos_token_id": 10**6},
            "tokenizer.ggml.eos_token_id is 1000000, not one of the 260 tokens",
        ),
        (  # written for another runtime's helpers: would fail every chat request
            {"tokenizer.chat_template": "{{ render_turns(messages) }}"},
            "the chat template fails on one user message: 'render_turns' is undefined",
        ),
    ],
    ids=["blocks", "heads", "eos", "template"],
)
def test_serve_check_refuses_a_bad_file_in_one_line_with_exit_2(
    tmp_path: Path, meta: dict[str, Any], message: str
) -> None:
    path = write_llama_gguf(tmp_path / "model.gguf", meta=meta)
    done = serve_check(path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"replystream serve: --engine gguf:PATH: {path}: {message}"


def with_nan(shape: tuple[int, ...], dtype: type = np.float32, bad: float = np.nan) -> np.ndarray:
    array: np.ndarray = np.full(shape, 0.01, dtype)
    array.flat[7] = bad
    return array


@pytest.mark.parametrize(
    ("name", "array"),
    [
        ("token_embd.weight", with_nan((260, 32))),
        ("blk.1.ffn_down.weight", with_nan((32, 64), bad=np.inf)),
        ("blk.0.attn_norm.weight", with_nan((32,), np.float16, -np.inf)),
    ],
)
def test_weights_that_are_not_finite_are_refused_at_load_naming_the_tensor(
    tmp_path: Path, name: str, array: np.ndarray
) -> None:
    path = write_llama_gguf(tmp_path / "model.gguf", tensors={name: array})
    with pytest.raises(ValueError, match=f"^{path}: tensor {name} holds values that are not fin"):
        load_gguf_engine(path)


def patched(path: Path, name: str, *, kind: int | None = None, offset: int | None = None) -> Path:
    """``path`` with tensor ``name``'s kind or data offset overwritten in its header."""
    reader = GGUFReader(path)
    field = next(t for t in reader.tensors if t.name == name).field
    data = bytearray(path.read_bytes())
    for value, part, fmt in ((kind, field.parts[-2], "<I"), (offset, field.parts[-1], "<Q")):
        if value is not None:
            at = part.ctypes.data - reader.data.ctypes.data  # where the value lies in the file
            struct.pack_into(fmt, data, at, value)
    out = path.with_name(f"patched-{path.name}")
    out.write_bytes(bytes(data))
    return out


def data_offset(path: Path, name: str) -> int:
    reader = GGUFReader(path)
    return int(next(t for t in reader.tensors if t.name == name).field.parts[-1][0])


F16 = int(GGMLQuantizationType.F16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # An F32 tensor said to be F16: half its bytes read, the rest left to no tensor.
        ({"name": "blk.0.attn_q.weight", "kind": F16}, "blk.0.attn_k.weight starts at data off"),
        ({"name": "blk.1.ffn_down.weight", "kind": F16}, "4096 bytes after the last tensor"),
        ({"name": "blk.1.ffn_down.weight", "offset": 3}, "blk.1.ffn_down.weight starts at data of"),
        ({"name": "blk.0.attn_k.weight", "offset": "blk.0.attn_q.weight"}, "attn_k.weight starts"),
    ],
)
def test_tensors_not_laid_out_one_after_another_are_refused(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    sound = write_llama_gguf(tmp_path / "model.gguf")
    if isinstance(change.get("offset"), str):  # overlapping the tensor of that name
        change = change | {"offset": data_offset(sound, change["offset"])}
    path = patched(sound, **change)
    with pytest.raises(ValueError, match=f"^{path}: not a readable GGUF file \\(.*{message}"):
        load_gguf_engine(path)


def test_a_quantised_block_with_an_infinite_scale_is_refused_without_a_warning(
    tmp_path: Path,
) -> None:
    blocks = quantize(np.full((64, 32), 0.01, np.float32), GGMLQuantizationType.Q8_0)
    blocks[0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # block 0's scale
    blocks[0, 2:34] = 0  # inf * 0: NaN, and NumPy's "invalid value" warning
    path = tmp_path / "model.gguf"
    write_llama_gguf(path, tensors={"blk.0.ffn_up.weight": blocks}, kind=GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight holds values that are not"):
        load_gguf_engine(path)  # the suite makes warnings errors: none may come first


def test_a_kind_this_engine_does_not_read_is_named_with_the_kinds_it_reads(
    tmp_path: Path,
) -> None:
    """MXFP4 weights are weights, of a kind this engine does not read: the refusal says so,
    and which kinds it does read."""
    path = write_llama_gguf(tmp_path / "model.gguf", kind=GGMLQuantizationType.MXFP4)
    with pytest.raises(ValueError, match="is of kind MXFP4, which this engine does not read") as no:
        load_gguf_engine(path)
    assert "(it reads F32, F16, BF16, Q4_0, " in str(no.value)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"tokenizer.chat_template": "{{ x }"}, "the chat template is not valid Jinja"),
        ({"pre": "qwen2"}, "pre-tokenizer 'qwen2' is not supported"),
    ],
    ids=["template", "pre-tokenizer"],
)
def test_serve_with_workers_says_a_bad_tokenizer_or_template_once_before_starting_any(
    tmp_path: Path, meta: dict[str, Any], message: str
) -> None:
    """Found without reading a weight, so by serve itself: not by each worker in turn, each
    saying it again, after the URL was announced."""
    path = write_llama_gguf(tmp_path / "model.gguf", meta=meta)
    argv = [sys.executable, "-m", "replystream", "serve", "--engine", f"gguf:{path}"]
    argv += ["--port", "0", "--workers", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"replystream serve: --engine gguf:PATH: {path}: {message}")
    assert done.stderr.count("\n") == 1, done.stderr


def test_a_file_cut_short_while_serving_does_not_take_the_weights_with_it(tmp_path: Path) -> None:
    """The file is mapped to read its header and tensors; the model must hold its weights in
    memory of its own. Float32 tensors left as views of the mapping would be read from the
    file at each step: a file cut short (copied over in place) kills the process by SIGBUS."""
    path = write_llama_gguf(tmp_path / "model.gguf")
    code = (
        "import asyncio, os, sys\n"
        "from pathlib import Path\n"
        "from replystream.engine.base import GenerationRequest, SamplingParams\n"
        "from replystream.engine.gguf_engine import load_gguf_engine\n"
        "engine, _ = load_gguf_engine(Path(sys.argv[1]))\n"
        "os.truncate(sys.argv[1], 64)\n"
        "async def main():\n"
        "    sampling = SamplingParams(max_tokens=3, temperature=0.0)\n"
        "    stream = await engine.start(GenerationRequest('the', sampling=sampling))\n"
        "    async for _ in stream:\n"
        "        pass\n"
        "    await engine.aclose()\n"
        "asyncio.run(main())\n"
        "print('answered')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, "answered\n"), done.stderr
