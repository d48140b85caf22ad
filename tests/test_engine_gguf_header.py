"""Our one-pass GGUF header reader against the ``gguf`` package's ``GGUFReader``.

Both read the same files: SmolLM2's, and files ``gguf.GGUFWriter`` writes with every value
type, nested arrays, a custom alignment and plain and quantised tensors. Every metadata value,
every tensor's name, kind, dims and bytes must agree. Damaged files are refused by name.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from replystream.engine.gguf_header import read_header
from tests.services import require_smollm2


def plain(value: Any) -> Any:
    """A metadata value with its arrays of numbers as lists, as ``GGUFReader`` gives them."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def assert_same_as_gguf_reader(path: Path) -> None:
    ours = read_header(path)
    theirs = GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == fields.keys()
    for key, value in fields.items():
        if key != "t.nested":  # GGUFReader.contents() flattens an array of arrays; we do not
            assert plain(ours.fields[key]) == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(n) for n in reference.shape), mine.name
        assert mine.data.dtype == reference.data.dtype, mine.name
        assert mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def test_smollm2s_header_and_tensors_read_as_gguf_reader_reads_them() -> None:
    assert_same_as_gguf_reader(require_smollm2())


def write_sample(path: Path, alignment: int | None = None) -> None:
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    values: list[tuple[str, Any, GGUFValueType]] = [
        ("t.u8", 200, GGUFValueType.UINT8),
        ("t.i8", -100, GGUFValueType.INT8),
        ("t.u16", 60000, GGUFValueType.UINT16),
        ("t.i16", -30000, GGUFValueType.INT16),
        ("t.u32", 4_000_000_000, GGUFValueType.UINT32),
        ("t.i32", -2_000_000_000, GGUFValueType.INT32),
        ("t.f32", 0.5, GGUFValueType.FLOAT32),
        ("t.bool", True, GGUFValueType.BOOL),
        ("t.str", "héllo 👋 世界\n", GGUFValueType.STRING),
        ("t.u64", 2**63 + 5, GGUFValueType.UINT64),
        ("t.i64", -(2**62), GGUFValueType.INT64),
        ("t.f64", 1e-300, GGUFValueType.FLOAT64),
    ]
    for key, value, kind in values:
        writer.add_key_value(key, value, kind)
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.25, -2.0])
    writer.add_array("t.strings", ["a", "", "Ġthe", "🙂", "x" * 300])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((4, 2)).astype(np.float16))
    q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_reads_as_gguf_reader_reads_it(
    tmp_path: Path, alignment: int | None
) -> None:
    path = tmp_path / "sample.gguf"
    write_sample(path, alignment)
    assert_same_as_gguf_reader(path)
    header = read_header(path)
    assert header.fields["t.str"] == "héllo 👋 世界\n"
    assert plain(header.fields["t.nested"]) == [[1, 2], [3]]
    assert header.fields["t.u64"] == 2**63 + 5


def test_an_array_of_numbers_is_a_read_only_view_of_the_file_in_its_own_dtype(
    tmp_path: Path,
) -> None:
    """Not a list: 20 million numbers as Python ints are most of a gigabyte, from an 80 MB
    file, for a key the model may never read."""
    path = tmp_path / "sample.gguf"
    write_sample(path)
    fields = read_header(path).fields
    for key, dtype in (("t.ints", np.int32), ("t.floats", np.float32)):
        assert isinstance(fields[key], np.ndarray), key
        assert fields[key].dtype == dtype and not fields[key].flags.writeable, key
    assert isinstance(fields["t.strings"], list)


def test_damaged_files_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    write_sample(good)
    data = good.read_bytes()
    cases = {
        b"GGML" + data[4:]: "no GGUF magic",
        data[:4] + struct.pack("<I", 1) + data[8:]: "version 1",
        data[:4] + struct.pack(">I", 3) + data[8:]: "big-endian",
        data[:200]: "cut short|past the end",  # the header cut short
        data[: len(data) - 40]: "past the end",  # into the last tensor (padding < 32 bytes)
    }
    for i, (content, message) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.gguf"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_header(bad)


def test_a_path_that_is_not_a_regular_file_is_refused_without_opening_it(tmp_path: Path) -> None:
    """A named pipe would block the open until something writes to it (``serve`` would hang
    at start-up, ``--check`` too); a directory is no file either."""
    import os
    import subprocess
    import sys

    pipe = tmp_path / "model.gguf"
    os.mkfifo(pipe)
    code = (
        "import sys; from pathlib import Path; from replystream.engine.gguf_header import "
        "read_header\ntry:\n    read_header(Path(sys.argv[1]))\nexcept ValueError as exc:\n"
        "    print(exc)"
    )
    for path in (pipe, tmp_path):
        done = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=20
        )
        assert done.stdout.strip() == "not a regular file", done.stderr


def test_arrays_nested_past_any_use_are_refused_not_recursed_into(tmp_path: Path) -> None:
    """Each level is 12 bytes: a 60 KB file would take the reader past Python's recursion
    limit, a traceback instead of a refusal."""
    key = b"general.deep"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    path = tmp_path / "deep.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="arrays nested more than 16 deep"):
        read_header(path)


def one_tensor(path: Path, name: str) -> tuple[bytearray, list[Any], GGUFReader]:
    """A sound file of one 2 x 2 tensor ``name``: its bytes to damage, its tensor's header
    parts (name, dim count, dims, kind, offset) and gguf's reader of it (where each lies)."""
    writer = GGUFWriter(path, "llama")
    writer.add_tensor(name, np.zeros((2, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFReader(path)
    return bytearray(path.read_bytes()), list(reader.tensors[0].field.parts), reader


@pytest.mark.parametrize(
    "dims", [(2**32, 2**32), (2**63 + 1, 1), (2**64 - 1, 2)], ids=["wraps", "past i64", "u64"]
)
def test_dims_whose_product_is_past_any_file_are_refused_naming_the_tensor(
    tmp_path: Path, dims: tuple[int, int]
) -> None:
    """Multiplied as 64-bit integers, 2^32 x 2^32 wraps to 0 elements (a tensor that fits in
    any file) and a dim past 2^63 warns; counted exactly, each runs past the end."""
    data, parts, reader = one_tensor(tmp_path / "sound.gguf", "t")
    at = parts[3].ctypes.data - reader.data.ctypes.data  # the dims, innermost first
    struct.pack_into("<QQ", data, at, *dims)
    path = tmp_path / "huge.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"^tensor t runs past the end of the file$"):
        read_header(path)


def test_a_tensor_kind_gguf_does_not_know_is_refused_naming_the_tensor_and_kind(
    tmp_path: Path,
) -> None:
    """A kind llama.cpp added after the installed gguf's release: the enum's own words
    ("4242 is not a valid GGMLQuantizationType") named neither the tensor nor the package."""
    data, parts, reader = one_tensor(tmp_path / "sound.gguf", "blk.0.attn_q.weight")
    at = parts[4].ctypes.data - reader.data.ctypes.data  # the kind, after the dims
    struct.pack_into("<I", data, at, 4242)
    path = tmp_path / "future.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as refused:
        read_header(path)
    message = str(refused.value)
    assert message.startswith("tensor blk.0.attn_q.weight is of kind 4242, which gguf 0.")
    assert "GGMLQuantizationType" not in message


def test_a_file_cut_short_or_empty_or_absent_is_told_in_words_of_its_own(tmp_path: Path) -> None:
    """A download that did not finish ends anywhere in the header: each place is told as the
    file cut short, not in ``struct``'s words about buffers; an empty file and a missing one
    in words of their own too, not ``mmap``'s."""
    good = tmp_path / "good.gguf"
    write_sample(good)
    data = good.read_bytes()
    # Inside the version, the counts, the first key's length, its value's type.
    for end in (6, 12, 20, 28, 54):
        cut = tmp_path / f"cut{end}.gguf"
        cut.write_bytes(data[:end])
        with pytest.raises(ValueError) as refused:
            read_header(cut)
        said = str(refused.value)
        assert said == f"the file ends at byte {end}, inside its header: it is cut short"
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^an empty file$"):
        read_header(empty)
    key = b"general.name"
    latin = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    latin += struct.pack("<IQ", 8, 4) + "café".encode("latin-1")
    bad_text = tmp_path / "latin.gguf"
    bad_text.write_bytes(latin)
    with pytest.raises(ValueError, match=r"^a string at byte 56 of the header is not UTF-8 text$"):
        read_header(bad_text)


def test_a_missing_file_is_one_line_naming_the_flag_and_the_file(tmp_path: Path) -> None:
    import subprocess
    import sys

    missing = tmp_path / "model.gguf"
    argv = [sys.executable, "-m", "replystream", "serve", "--engine", f"gguf:{missing}", "--check"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    said = f"--engine gguf:PATH: {missing}: cannot be read (No such file or directory)"
    assert done.stderr == f"replystream serve: {said}\n"


LFS_POINTER = (
    b"version https://git-lfs.github.com/spec/v1\n"
    b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    b"size 98362432\n"
)


def test_a_git_lfs_pointer_in_place_of_the_model_is_told_as_that(tmp_path: Path) -> None:
    """A model repository cloned without Git LFS holds a pointer of a hundred bytes in place
    of each large file: it was refused as a file with no GGUF magic, which said nothing of
    why, nor of what to do."""
    pointer = tmp_path / "model.gguf"
    pointer.write_bytes(LFS_POINTER)
    with pytest.raises(ValueError) as refused:
        read_header(pointer)
    assert str(refused.value) == (
        "a Git LFS pointer, not the file of 98,362,432 bytes it stands for: fetch that file "
        "(git lfs pull)"
    )


def test_a_metadata_key_given_twice_is_refused_not_read_as_its_last_value(tmp_path: Path) -> None:
    """llama.cpp and gguf's own reader refuse a file that gives a key twice; the last value
    was taken here without a word, so the same file ran as another model than theirs."""

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value.encode())) + value.encode()

    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    for value in (2048, 8192):
        data += text("llama.context_length") + struct.pack("<II", 4, value)
    path = tmp_path / "twice.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"^metadata key llama\.context_length is given twice$"):
        read_header(path)


@pytest.mark.parametrize(("kind", "least"), [(8, 8), (9, 12)], ids=["strings", "arrays"])
def test_an_array_counting_more_items_than_the_file_holds_is_refused_at_its_count(
    tmp_path: Path, kind: int, least: int
) -> None:
    """A damaged count (2^60) of strings or arrays: each item takes at least ``least`` bytes,
    so the count alone shows it runs past the end. It was read item by item to the end of
    the file and told as a file cut short, which it is not."""
    key = b"tokenizer.ggml.tokens"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<IIQ", 9, kind, 2**60) + struct.pack("<Q", 0) * 64
    path = tmp_path / "count.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"^an array of {2**60} values runs past the end of"):
        read_header(path)
