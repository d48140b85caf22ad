"""Small LLaMA-architecture GGUF files written for tests: a sound one, or one with a change.

``write_llama_gguf`` writes a 2-layer model of a few dozen dimensions over a byte-level
vocabulary (the 256 byte symbols, three ChatML control tokens and one merge), in float32 or
a quantised kind. ``meta`` changes or drops (``None``) ``llama.*`` and ``tokenizer.ggml.*``
values by their key after the prefix (or any value by its whole key); ``tensors`` changes or
drops (``None``) tensors by name, or adds ones the model does not have.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


TOKENS = [*byte_symbols(), "<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt"]
TOKEN_TYPES = [1] * 256 + [3, 3, 3, 1]
MERGES = ["Ġ t"]
D, LAYERS, HEADS, KV_HEADS, FF, CONTEXT = 32, 2, 4, 2, 64, 256


def llama_shapes(
    d: int = D, layers: int = LAYERS, heads: int = HEADS, kv_heads: int = KV_HEADS, ff: int = FF
) -> dict[str, tuple[int, ...]]:
    """Every tensor of a llama GGUF with a tied output, (out, in) as NumPy lays it out."""
    hd = d // heads
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (len(TOKENS), d),
        "output_norm.weight": (d,),
    }
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (heads * hd, d),
            f"blk.{i}.attn_k.weight": (kv_heads * hd, d),
            f"blk.{i}.attn_v.weight": (kv_heads * hd, d),
            f"blk.{i}.attn_output.weight": (d, heads * hd),
            f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_gate.weight": (ff, d),
            f"blk.{i}.ffn_up.weight": (ff, d),
            f"blk.{i}.ffn_down.weight": (d, ff),
        }
    return shapes


def _add(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        kind = GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64
        writer.add_key_value(key, value, kind)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, str(value))


def write_llama_gguf(
    path: Path,
    *,
    meta: Mapping[str, Any] | None = None,
    tensors: Mapping[str, np.ndarray | None] | None = None,
    kind: GGMLQuantizationType = GGMLQuantizationType.F32,
) -> Path:
    """Write a small llama GGUF at ``path``, changed as ``meta`` and ``tensors`` say."""
    values: dict[str, Any] = {
        "llama.context_length": CONTEXT,
        "llama.embedding_length": D,
        "llama.block_count": LAYERS,
        "llama.feed_forward_length": FF,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": TOKEN_TYPES,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 257,
        "tokenizer.ggml.eos_token_id": 258,
        "tokenizer.chat_template": CHATML,
    }
    for key, value in (meta or {}).items():
        if key.startswith(("llama.", "tokenizer.", "general.")):
            full = key
        elif f"tokenizer.ggml.{key}" in values:
            full = f"tokenizer.ggml.{key}"
        else:
            full = f"llama.{key}"
        if value is None:
            values.pop(full, None)
        else:
            values[full] = value
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray | None] = {}
    for name, shape in llama_shapes().items():
        if name.endswith("norm.weight"):
            arrays[name] = np.ones(shape, np.float32)
        else:
            arrays[name] = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    arrays |= dict(tensors or {})
    writer = GGUFWriter(path, "llama")
    writer.add_name(path.stem)
    for key, value in values.items():
        _add(writer, key, value)
    for name, array in arrays.items():
        if array is None:
            continue
        if kind != GGMLQuantizationType.F32 and array.ndim == 2 and array.dtype == np.float32:
            raw = quantize(array, kind)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        elif array.dtype == np.uint8:  # blocks already quantised to ``kind``
            writer.add_tensor(name, array, raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
