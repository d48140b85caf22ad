"""A GGUF file's header read in one pass: its metadata values and where each tensor's bytes are.

This file decides how the bytes of a GGUF header (version 2 or 3, little-endian) become Python
values and memory-mapped tensor views. ``gguf.GGUFReader`` reads the same header but builds a
NumPy view for every part of every value: on SmolLM2's 49,152 tokens and 48,900 merges that is
about a million small arrays and most of a 6-second load. Here a string is ``struct`` and a
slice, a numeric array one ``np.frombuffer``: a read-only view of the mapping, never a list, so
a key nobody reads costs no memory however long its array (20 million numbers as a Python list
are most of a gigabyte, from an 80 MB file). Whoever keeps such an array past the load copies
it: a view of a file cut short later would end the process by SIGBUS when read. The tensors
come out as ``GGUFReader`` gives them (same dtype and shape: raw bytes for quantised kinds), so
``gguf.quants.dequantize`` takes them unchanged; ``tests/test_engine_gguf_header.py`` checks
both readers agree on the whole file. It must not know what the metadata means
(``gguf_file.py`` does) nor how to dequantise.
"""

from __future__ import annotations

import importlib.metadata
import math
import mmap
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape
from numpy.typing import NDArray

from replystream.engine.lfs_pointer import lfs_pointer_words

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted with 32-bit integers; no file of it is still made
DEFAULT_ALIGNMENT = 32
MAX_NESTING = 16  # arrays within arrays: no writer nests more than a couple
_SHOWN_ITEMS = 8  # an array of numbers longer than this is counted in a refusal, not listed

# GGUF value type -> (struct format, NumPy dtype) of the fixed-size kinds.
_SCALARS: dict[int, tuple[str, np.dtype[Any]]] = {
    0: ("<B", np.dtype("<u1")),
    1: ("<b", np.dtype("<i1")),
    2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")),
    5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")),
    7: ("<?", np.dtype("?")),
    10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")),
    12: ("<d", np.dtype("<f8")),
}
_STRING, _ARRAY = 8, 9
_LEAST_BYTES = {_STRING: 8, _ARRAY: 12}  # a string's length; an array's item kind and count
# Tensor kinds stored as plain numbers (any other kind is bytes, in blocks).
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor: its name, kind, dims (innermost first, as stored) and its mapped data."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: NDArray[Any]  # as GGUFReader gives it: numbers, or (rows..., bytes per row) uint8


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """The metadata and the tensors of a GGUF file.

    ``fields``: key -> value; an array of numbers is a read-only NumPy view of the file's
    mapping (of the file's own dtype), an array of strings or of arrays a list.
    """

    version: int
    fields: dict[str, Any]
    tensors: list[TensorInfo]


def shown(value: Any) -> str:
    """A metadata value as a refusal names it: an array of numbers as a short list, or counted."""
    if isinstance(value, np.ndarray):
        return repr(value.tolist()) if value.size <= _SHOWN_ITEMS else f"{value.size} numbers"
    return repr(value)


class _Cursor:
    """Reads little-endian values from a buffer, advancing an offset."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buffer):
            # A download that did not finish ends anywhere: told as that, not in ``struct``'s
            # words about buffers and offsets.
            raise ValueError(
                f"the file ends at byte {len(self.buffer)}, inside its header: it is cut short"
            )
        value = struct.unpack_from(fmt, self.buffer, self.at)[0]
        self.at += size
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        end = self.at + size
        if end > len(self.buffer):
            raise ValueError(f"a string of {size} bytes runs past the end of the file")
        try:
            text = self.buffer[self.at : end].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"a string at byte {self.at} of the header is not UTF-8 text"
            ) from None
        self.at = end
        return text

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            if depth == MAX_NESTING:  # each level is 12 bytes: a small file, a deep recursion
                raise ValueError(f"arrays nested more than {MAX_NESTING} deep")
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            scalar = _SCALARS.get(item_kind)
            # The fewest bytes an item takes: a damaged count is refused as it is read, not
            # after reading items to the end of the file (as if the file were cut short).
            least = scalar[1].itemsize if scalar else _LEAST_BYTES.get(item_kind, 0)
            if self.at + count * least > len(self.buffer):
                raise ValueError(f"an array of {count} values runs past the end of the file")
            if scalar is None:  # strings or nested arrays: one by one
                return [self.value(item_kind, depth + 1) for _ in range(count)]
            dtype = scalar[1]
            items = np.frombuffer(self.buffer, dtype, count, self.at)
            self.at += count * dtype.itemsize
            return items
        scalar = _SCALARS.get(kind)
        if scalar is None:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.unpack(scalar[0])


def read_header(path: Path) -> GGUFHeader:
    """Map ``path`` and read its header; tensor data stay in the mapping until used.

    Raises:
        OSError: ``path`` cannot be read (it is not there, say).
        ValueError: not a regular file, an empty file, a Git LFS pointer, not a GGUF file, a
            version or byte order this reader does not read, a header that runs past the end
            of the file (a file cut short), text that is not UTF-8, or tensors not laid out
            one after another as the header lists them (each named in the message).
    """
    # A named pipe would block the open until something writes to it (a server that never
    # starts), a device has no size to map: only a regular file is opened.
    status = path.stat()
    if not stat.S_ISREG(status.st_mode):
        raise ValueError("not a regular file")
    if status.st_size == 0:  # which ``mmap`` refuses in words of its own
        raise ValueError("an empty file")
    pointer = lfs_pointer_words(path)
    if pointer is not None:
        raise ValueError(pointer)
    with path.open("rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buffer)
    except (struct.error, OverflowError) as exc:
        raise ValueError(f"a damaged GGUF header ({exc})") from None


def _tensor_kind(name: str, number: int) -> GGMLQuantizationType:
    """The kind of tensor ``name``, told in our words when the installed gguf does not know it
    (a kind added to llama.cpp after that release: the enum's own message names no tensor)."""
    try:
        return GGMLQuantizationType(number)
    except ValueError:
        raise ValueError(
            f"tensor {name} is of kind {number}, which gguf {_gguf_version()} does not know: "
            "a newer gguf package may read it"
        ) from None


def _gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree
        return "(of unknown version)"


def _parse(buffer: mmap.mmap) -> GGUFHeader:
    if buffer[:4] != MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    cursor = _Cursor(buffer)
    cursor.at = 4
    version = cursor.unpack("<I")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            raise ValueError("a big-endian GGUF file; this reader reads little-endian ones")
        raise ValueError(f"GGUF version {version}; this reader reads versions 2 and 3")
    tensor_count, field_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(field_count):
        key = cursor.string()
        if key in fields:  # as llama.cpp and gguf's reader refuse it: neither value is sure
            raise ValueError(f"metadata key {key} is given twice")
        fields[key] = cursor.value(cursor.unpack("<I"))
    described = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        described.append((name, dims, _tensor_kind(name, cursor.unpack("<I")), cursor.unpack("<Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise ValueError(f"general.alignment is {shown(alignment)}; it must be a power of two")
    data_start = -(-cursor.at // alignment) * alignment
    tensors = []
    # Tensors lie one after another in the order the header lists them, each at the next
    # multiple of the alignment, as every writer lays them out and llama.cpp requires. A
    # tensor elsewhere overlaps another or leaves bytes no tensor reads, which is what a
    # damaged offset or a relabelled kind (so a wrong byte count) looks like.
    expected = 0  # where the next tensor must start, from ``data_start``
    for name, dims, kind, offset in described:
        shape = tuple(reversed(dims))  # outermost first, as NumPy lays it out
        count = math.prod(dims)  # exact: as 64-bit integers, 2^32 x 2^32 would be 0
        plain = _PLAIN.get(kind)
        if plain is not None:
            dtype, items = np.dtype(plain), count
        else:
            block, type_size = GGML_QUANT_SIZES[kind]
            dtype, items = np.dtype(np.uint8), count * type_size // block
            shape = quant_shape_to_byte_shape(shape, kind)
        start = data_start + offset
        if start + items * dtype.itemsize > len(buffer):
            raise ValueError(f"tensor {name} runs past the end of the file")
        if offset != expected:
            raise ValueError(
                f"tensor {name} starts at data offset {offset}; the tensors before it "
                f"end at {expected}"
            )
        expected = -(-(offset + items * dtype.itemsize) // alignment) * alignment
        data = np.frombuffer(buffer, dtype, items, start).reshape(shape)
        tensors.append(TensorInfo(name, kind, dims, data))
    if len(buffer) > data_start + expected:  # the last tensor's padding may be left out
        raise ValueError(f"{len(buffer) - data_start - expected} bytes after the last tensor")
    return GGUFHeader(version, fields, tensors)
