"""Whether this engine can run a llama GGUF: its metadata and tensors checked before any weight.

This file decides which files are refused at load, and why, so that a file the model would
compute wrongly, or crash on at its first request, never starts serving:
1. The shape comes from the metadata (``llama.*``): the counts it needs are present, whole and
   positive; the heads divide the embedding and the KV heads divide the heads; the rotary
   embedding covers the whole head, unscaled; the model is dense (no experts).
2. The tensors must be exactly those the model computes, each of the shape that metadata
   implies (as llama.cpp checks every tensor it creates): first the block count against the
   ``blk.N.*`` tensors actually present (so a claimed count costs nothing), then every tensor.
   A tensor the model would not use (``rope_freqs.weight``, biases, experts) is refused, since
   running without it is running another model.
3. Each tensor's kind is one the ``gguf`` package dequantises to floats.
4. The vocabulary's special ids name tokens it holds.
Every refusal is a ValueError naming the key, the tensor or the id. It must not know how the
header is parsed (``gguf_header.py``), how weights are dequantised or named for the model
(``gguf_file.py``), nor how the tokenizer splits text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from replystream.engine.gguf_header import TensorInfo, shown
from replystream.engine.model import ModelConfig

_Q = GGMLQuantizationType
# Kinds ``gguf.quants.dequantize`` turns into floats (integer kinds hold no weights).
WEIGHT_KINDS = frozenset(
    {
        _Q.F32, _Q.F16, _Q.BF16,
        _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
        _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
        _Q.IQ1_S, _Q.IQ1_M, _Q.IQ2_XXS, _Q.IQ2_XS, _Q.IQ2_S, _Q.IQ3_XXS, _Q.IQ3_S,
        _Q.IQ4_NL, _Q.IQ4_XS, _Q.TQ1_0, _Q.TQ2_0,
    }
)  # fmt: skip
_READ_ORDER = [_Q.F32, _Q.F16, _Q.BF16, *(k for k in _Q if k not in (_Q.F32, _Q.F16, _Q.BF16))]
_BLOCK = re.compile(r"blk\.(\d+)\.")
# Why a tensor the model does not compute is there, where a name says it.
_UNUSED_WHY = {
    "rope_freqs.weight": "Llama 3.1's rope scaling",
    ".bias": "biases",
    "_exps.": "experts",
}
_SHOWN = 4  # unexpected tensors named in a refusal; the rest are counted


def _count(fields: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """A whole, positive ``llama.{key}``; ``default`` when absent (None: it is required)."""
    value = fields.get(f"llama.{key}")
    if value is None:
        if default is None:
            raise ValueError(f"no llama.{key} in the metadata")
        return default
    if isinstance(value, list | np.ndarray):
        raise ValueError(f"llama.{key} is given per layer; this engine runs uniform layers")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"llama.{key} is {shown(value)}; it must be a whole number of at least 1")
    return value


def _one(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``llama.{key}``, one value (``default`` when absent); an array is refused by name."""
    value = fields.get(f"llama.{key}", default)
    if isinstance(value, list | np.ndarray):
        raise ValueError(f"llama.{key} is {shown(value)}; it must be one value, not an array")
    return value


def _positive(fields: Mapping[str, Any], key: str, default: float) -> float:
    value = fields.get(f"llama.{key}", default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"llama.{key} is {shown(value)}; it must be a number")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"llama.{key} is {value!r}; it must be a finite number above 0")
    return float(value)


def model_config(fields: Mapping[str, Any], n_tokens: int) -> ModelConfig:
    """The model's shape as the metadata gives it, checked (``n_tokens``: the vocabulary's).

    Raises:
        ValueError: a value missing or unusable, or a model this engine does not compute.
    """
    experts = _one(fields, "expert_count")
    if experts:
        raise ValueError(f"a mixture of {experts!r} experts; this engine runs dense models")
    n_heads = _count(fields, "attention.head_count")
    d_model = _count(fields, "embedding_length")
    n_kv_heads = _count(fields, "attention.head_count_kv", n_heads)
    if d_model % n_heads:
        raise ValueError(f"llama.embedding_length {d_model} is not a multiple of {n_heads} heads")
    head_dim = d_model // n_heads
    if head_dim % 2:
        raise ValueError(f"the head dimension {head_dim} is odd; rotary embedding pairs them")
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} attention heads do not share {n_kv_heads} KV heads evenly")
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if _count(fields, key, head_dim) != head_dim:
            raise ValueError(
                f"llama.{key} is {fields[f'llama.{key}']}; this engine runs heads of "
                f"{head_dim} (embedding_length / head_count) under a rotary embedding of all"
            )
    scaling = _one(fields, "rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} is not supported (only 'none')")
    factor = _one(fields, "rope.scaling.factor", 1.0)
    if factor not in (0.0, 1.0):  # llama.cpp reads 0 as no scaling
        raise ValueError(f"llama.rope.scaling.factor {factor!r} is not supported (only 1)")
    context = _count(fields, "context_length")
    if context < 2:  # served, every request would be refused as longer than the context
        raise ValueError(
            f"llama.context_length is {context}; a prompt and its reply need at least 2"
        )
    vocab_size = _one(fields, "vocab_size", n_tokens)
    if vocab_size != n_tokens:
        raise ValueError(f"llama.vocab_size is {vocab_size!r} but the vocabulary has {n_tokens}")
    return ModelConfig(
        vocab_size=n_tokens,
        d_model=d_model,
        n_layers=_count(fields, "block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=_count(fields, "feed_forward_length"),
        context=context,
        rope_theta=_positive(fields, "rope.freq_base", 10000.0),
        norm_eps=_positive(fields, "attention.layer_norm_rms_epsilon", 1e-5),
    )


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama GGUF of shape ``c`` holds, (out, in) as NumPy lays it out.

    ``output.weight`` is among them; a file may leave it out (the embedding is tied).
    """
    d, hd = c.d_model, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (c.vocab_size, d),
        "output_norm.weight": (d,),
        "output.weight": (c.vocab_size, d),
    }
    for i in range(c.n_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (c.n_heads * hd, d),
            f"blk.{i}.attn_k.weight": (c.n_kv_heads * hd, d),
            f"blk.{i}.attn_v.weight": (c.n_kv_heads * hd, d),
            f"blk.{i}.attn_output.weight": (d, c.n_heads * hd),
            f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_gate.weight": (c.d_ff, d),
            f"blk.{i}.ffn_up.weight": (c.d_ff, d),
            f"blk.{i}.ffn_down.weight": (d, c.d_ff),
        }
    return shapes


def _why_unused(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    if len(names) > _SHOWN:
        shown += f" and {len(names) - _SHOWN} more"
    reasons = sorted({why for part, why in _UNUSED_WHY.items() for n in names if part in n})
    return shown + (f" ({', '.join(reasons)})" if reasons else "")


def check_tensors(tensors: Sequence[TensorInfo], config: ModelConfig) -> None:
    """The file's tensors are exactly the model's, each of its shape and of a float kind.

    Raises:
        ValueError: naming the first tensor missing, extra, misshapen or of another kind.
    """
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"tensor {twice[0]} is in the file more than once")
    blocks = {int(m.group(1)) for n in names if (m := _BLOCK.match(n))}
    # Distinct whole numbers from 0, as many as the count and none past it: 0..count-1, found
    # without a loop or set as large as the count the file claims.
    if len(blocks) != config.n_layers or max(blocks) != config.n_layers - 1:
        found = f"blocks 0 to {max(blocks)}" if blocks else "no blk.N tensors"
        missing = sorted(set(range(max(blocks, default=-1) + 1)) - blocks)
        gap = f", none of block {missing[0]}" if missing else ""
        raise ValueError(f"llama.block_count is {config.n_layers} but the file has {found}{gap}")
    expected = tensor_shapes(config)
    unused = [n for n in names if n not in expected]
    if unused:
        raise ValueError(f"tensors this engine does not compute: {_why_unused(unused)}")
    present = set(names)
    for name in expected:
        if name not in present and name != "output.weight":
            raise ValueError(f"no tensor {name}")
    for t in tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if shape != expected[t.name]:
            raise ValueError(
                f"tensor {t.name} is {'x'.join(map(str, shape))}; the metadata makes it "
                f"{'x'.join(map(str, expected[t.name]))}"
            )
        if t.tensor_type not in WEIGHT_KINDS:
            read = ", ".join(kind.name for kind in sorted(WEIGHT_KINDS, key=_READ_ORDER.index))
            raise ValueError(
                f"tensor {t.name} is of kind {t.tensor_type.name}, which this engine does not "
                f"read (it reads {read})"
            )


def check_token_ids(ids: Mapping[str, Any], n_tokens: int) -> None:
    """Each special token id the file names (``bos``, ``eos``...) is one of its ``n_tokens``.

    Raises:
        ValueError: naming the key and the id.
    """
    for key, value in ids.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_tokens:
            raise ValueError(
                f"tokenizer.ggml.{key}_token_id is {shown(value)}, not one of the {n_tokens} tokens"
            )
