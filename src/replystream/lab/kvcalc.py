"""``replystream kv``: how much KV cache a model needs, how many sequences fit, and what a decode
step must read from memory.

This file decides the arithmetic (the reference article's formula, exactly, in integer bytes)
and the published shapes of a few well-known models. It must not know about servers, clients or
any real allocator: activations and an allocator's own overheads are outside the formula; a
paged cache's block rounding is in it when the query gives a block size.

    KV bytes = 2 (K and V) x layers x cached tokens x KV heads x head dim x bytes per element

A sliding-window model caches at most ``window`` tokens per sequence. A paged cache (ours, vLLM's)
hands a sequence whole blocks of ``block_size`` tokens, so it holds its tokens rounded up to
whole blocks, and a memory holds whole blocks: with a block size the figures are the blocks'.
A decode step at batch B reads every weight once plus each active sequence's cached tokens, so
memory bandwidth bounds it below: ``(weights + B x cache per sequence) / bandwidth``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from replystream.cli_values import Checker, float_between, int_between

# Bits per cached element: int4 packs two elements per byte.
DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}

GIB = 1 << 30
GB = 10**9
TB = 10**12

# The memory (GiB), weights (GB) and bandwidth (TB/s) a query may give: from about a byte (a
# KB/s) to far beyond any machine. Outside, the arithmetic leaves the floats' range (a
# memory of 1e300 GiB is infinite bytes; a bandwidth of 1e300 TB/s makes a step take 0 s).
AMOUNTS = ("memory_gib", "weights_gb", "bandwidth_tbs")
AMOUNT_RANGE = (1e-9, 1e12)
# The largest whole number each count may be, far beyond any model: with the amounts above,
# every derived number stays within the floats' range (a cache of 10^400 tokens does not).
LARGEST = {
    "layers": 10**6,
    "kv_heads": 10**6,
    "head_dim": 10**6,
    "tokens": 10**12,
    "sliding_window": 10**12,
    "batch": 10**9,
    "block_size": 10**12,
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The attention shape that sizes the cache, as published in the model's ``config.json``."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    context: int  # max_position_embeddings
    params_b: float  # total parameters, billions (weights in bf16 = 2 bytes each)
    sliding_window: int | None = None


# head_dim = hidden_size / num_attention_heads in each config.
PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        # hidden 4096, 32 query heads, 8 KV heads (GQA)
        ModelShape("llama-3-8b", 32, 8, 128, 8192, 8.03),
        # hidden 8192, 64 query heads, 8 KV heads (GQA)
        ModelShape("llama-3-70b", 80, 8, 128, 8192, 70.55),
        # hidden 4096, 32 query heads, 32 KV heads: full multi-head attention, 4x the cache
        ModelShape("llama-2-7b", 32, 32, 128, 4096, 6.74),
        # hidden 4096, 32 query heads, 8 KV heads, every layer windowed to 4,096 tokens
        ModelShape("mistral-7b-v0.1", 32, 8, 128, 32768, 7.24, sliding_window=4096),
        # hidden 3584, 28 query heads, 4 KV heads; no window (use_sliding_window is false);
        # context as in Qwen2-7B-Instruct's config (longer contexts need YaRN scaling)
        ModelShape("qwen2-7b", 28, 4, 128, 32768, 7.62),
        # hidden 576, 9 query heads, 3 KV heads: SmolLM2-135M-Instruct, the model ``serve``
        # runs by default (whose cache is float32 there: ``--dtype fp32 --block-size 16``)
        ModelShape("smollm2-135m", 30, 3, 64, 8192, 0.135),
    )
}


@dataclass(frozen=True, slots=True)
class KVQuery:
    """What to size. Memory in GiB (2^30 bytes); weights in GB (10^9); bandwidth in TB/s."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: str = "bf16"
    sliding_window: int | None = None
    memory_gib: float | None = None
    weights_gb: float | None = None
    bandwidth_tbs: float | None = None
    batch: int = 1
    block_size: int | None = None  # tokens per block of a paged cache (None: no blocks)

    def __post_init__(self) -> None:
        for name, largest in LARGEST.items():
            value = getattr(self, name)
            if value is not None and not 1 <= value <= largest:
                raise ValueError(f"{name} must be from 1 to {largest}")
        if self.dtype not in DTYPE_BITS:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BITS)}")
        low, high = AMOUNT_RANGE
        for name in AMOUNTS:
            value = getattr(self, name)
            if value is not None and not low <= value <= high:  # NaN is refused too
                raise ValueError(f"{name} must be from {low:g} to {high:g}")


def kv_sizes(query: KVQuery) -> dict[str, Any]:
    """Every derived number for ``query`` (the ``--json`` contract)."""
    bits = DTYPE_BITS[query.dtype]
    bytes_per_token = 2 * query.layers * query.kv_heads * query.head_dim * bits // 8
    cached = query.tokens
    if query.sliding_window is not None:
        cached = min(cached, query.sliding_window)
    # What a sequence holds: its cached tokens, or the whole blocks they take (a block is one
    # "token" of the pool, so the fit below counts blocks).
    unit, per_unit = 1, cached
    if query.block_size is not None:
        unit = query.block_size
        per_unit = blocks_per_sequence(query.tokens, query.sliding_window, unit)
    bytes_per_unit = bytes_per_token * unit
    per_sequence = bytes_per_unit * per_unit
    out: dict[str, Any] = {
        "inputs": asdict(query),
        "bytes_per_element": bits / 8,
        "bytes_per_token": bytes_per_token,
        "cached_tokens_per_sequence": cached,
        "bytes_per_sequence": per_sequence,
    }
    if query.block_size is not None:
        out["bytes_per_block"] = bytes_per_unit
        out["blocks_per_sequence"] = per_unit
    if query.memory_gib is not None:
        memory = query.memory_gib * GIB
        units = int(memory // bytes_per_unit)
        out["memory_bytes"] = memory
        if query.block_size is not None:
            out["blocks_that_fit"] = units
        out["sequences_that_fit"] = units // per_unit
        out["tokens_that_fit"] = units * unit
    if query.bandwidth_tbs is not None:
        bandwidth = query.bandwidth_tbs * TB
        weights = (query.weights_gb or 0.0) * GB
        # A step reads the tokens cached, not the empty slots of a sequence's last block.
        batch_cache = query.batch * bytes_per_token * cached
        step_s = (weights + batch_cache) / bandwidth
        out["decode_step"] = {
            "batch": query.batch,
            "weights_bytes": weights,
            "batch_cache_bytes": batch_cache,
            "bytes_read_per_step": weights + batch_cache,
            "weights_only_floor_ms": weights / bandwidth * 1000,
            "step_floor_ms": step_s * 1000,
            "tokens_per_s_ceiling": query.batch / step_s,
        }
        if "sequences_that_fit" in out:
            # The floor is the bandwidth's; a batch the memory cannot hold never runs at all.
            out["decode_step"]["batch_fits_memory"] = query.batch <= out["sequences_that_fit"]
    return out


def blocks_per_sequence(tokens: int, window: int | None, block_size: int) -> int:
    """Blocks of ``block_size`` tokens a sequence of ``tokens`` holds at most.

    A window's tokens start anywhere in a block: ``window`` of them may touch one block more
    than they fill (a window of 4,096 in blocks of 16 spans 257 blocks at most).
    """
    blocks = -(-tokens // block_size)
    if window is not None and window < tokens:
        blocks = min(blocks, -(-(window - 1) // block_size) + 1)
    return blocks


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the value at least 1 (``128 KiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if value == int(value) else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _amount(value: float) -> str:
    """An amount as it was given: ``40``, ``1.40625``, ``0.001953125`` (a pool of whole
    blocks in GiB has many digits; ``:g`` keeps six and would name another amount)."""
    return f"{value:.15g}"


def render(result: dict[str, Any]) -> str:
    """The human-readable report of ``kv_sizes``."""
    q = result["inputs"]
    formula = (
        f"2 x {q['layers']} layers x {q['kv_heads']} KV heads x {q['head_dim']} dim"
        f" x {result['bytes_per_element']:g} B ({q['dtype']})"
    )
    lines = [
        f"per token:     {formula} = {result['bytes_per_token']:,} B"
        f" = {format_bytes(result['bytes_per_token'])}",
    ]
    cached = result["cached_tokens_per_sequence"]
    window = f" (window caps {q['tokens']:,} at {cached:,})" if cached < q["tokens"] else ""
    size = q["block_size"]
    blocks = "" if size is None else f" in {result['blocks_per_sequence']:,} blocks of {size:,}"
    lines.append(
        f"per sequence:  {cached:,} tokens{window}{blocks} = {result['bytes_per_sequence']:,} B"
        f" = {format_bytes(result['bytes_per_sequence'])}"
    )
    if "sequences_that_fit" in result:
        pool = "" if size is None else f"{result['blocks_that_fit']:,} blocks: "
        # Blocks count the slots a sequence's last block leaves empty: the fragmentation.
        left_out = "weights and activations"
        if size is None:
            left_out = "weights, activations and fragmentation"
        lines.append(
            f"{'in ' + _amount(q['memory_gib']) + ' GiB:':<14} {pool}"
            f"{result['sequences_that_fit']:,} full-length"
            f" sequence{'' if result['sequences_that_fit'] == 1 else 's'}"
            f" ({result['tokens_that_fit']:,} tokens), before {left_out}"
        )
    step = result.get("decode_step")
    if step is not None:
        read = result["bytes_per_token"] * cached
        lines.append(
            f"decode step:   ({step['weights_bytes'] / GB:,.2f} GB weights"
            f" + {step['batch']} x {format_bytes(read)}{'' if size is None else ' cached'}"
            f" = {step['batch_cache_bytes'] / GB:,.2f} GB cache)"
            f" / {_amount(q['bandwidth_tbs'])} TB/s >= {step['step_floor_ms']:,.2f} ms"
            f" (weights alone: {step['weights_only_floor_ms']:,.2f} ms);"
            f" at most {step['tokens_per_s_ceiling']:,.0f} tokens/s{_beyond_memory(result)}"
        )
    return "\n".join(lines)


def _beyond_memory(result: dict[str, Any]) -> str:
    """What the decode step's line adds when the memory given cannot hold its batch."""
    if result["decode_step"].get("batch_fits_memory", True):
        return ""
    q, batch = result["inputs"], result["decode_step"]["batch"]
    return (
        f", but {batch:,} sequences need {format_bytes(batch * result['bytes_per_sequence'])}"
        f" of cache: {_amount(q['memory_gib'])} GiB holds {result['sequences_that_fit']:,}"
    )


def _count(field: str) -> Checker[int]:
    return int_between(1, LARGEST[field])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=sorted(PRESETS),
        help="take layers, KV heads, head dim, window, context and weights (bf16) from a preset",
    )
    parser.add_argument("--layers", type=_count("layers"))
    parser.add_argument("--kv-heads", type=_count("kv_heads"))
    parser.add_argument("--head-dim", type=_count("head_dim"))
    parser.add_argument(
        "--tokens", type=_count("tokens"), help="tokens per sequence (preset: its context)"
    )
    parser.add_argument("--dtype", choices=list(DTYPE_BITS), default="bf16", help="cache elements")
    parser.add_argument(
        "--window",
        type=_count("sliding_window"),
        help="sliding window: tokens cached per sequence",
    )
    amount = float_between(*AMOUNT_RANGE)
    parser.add_argument("--memory-gib", type=amount, help="memory left for the cache, GiB")
    parser.add_argument("--weights-gb", type=amount, help="weight bytes read per step, GB")
    parser.add_argument("--bandwidth-tbs", type=amount, help="memory bandwidth, TB/s")
    parser.add_argument(
        "--batch",
        type=_count("batch"),
        help="full-length sequences per step, with --bandwidth-tbs (default: 1)",
    )
    parser.add_argument(
        "--block-size",
        type=_count("block_size"),
        help="tokens per block of a paged cache: each sequence holds whole blocks "
        "(replystream's engine: 16; default: no blocks)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _shape_value(given: int | None, preset: ModelShape | None, field: str) -> int:
    if given is not None:
        return given
    if preset is None:
        raise ValueError(f"give --model or --{field.replace('_', '-')}")
    value: int = getattr(preset, "context" if field == "tokens" else field)
    return value


# The shape options a preset gives, by the preset's field: each may be given to change it.
SHAPE_FLAGS = {"layers": "layers", "kv_heads": "kv_heads", "head_dim": "head_dim"}


def shape_changes(args: argparse.Namespace) -> dict[str, int]:
    """The preset's shape fields the options change (field -> the value given)."""
    if not args.model:
        return {}
    preset = PRESETS[args.model]
    given = {field: getattr(args, dest) for field, dest in SHAPE_FLAGS.items()}
    given["sliding_window"] = args.window
    return {f: v for f, v in given.items() if v is not None and v != getattr(preset, f)}


def query_from_args(args: argparse.Namespace) -> KVQuery:
    """Explicit options win over the preset's values; raises ValueError for a decode-step
    option without the bandwidth that bounds the step (it would be ignored), the bandwidth
    with no weights to read (neither given nor a preset's), or for more
    tokens per sequence than the preset's model can attend to (no sequence is that long)."""
    if args.bandwidth_tbs is None:
        for flag, value in (("--weights-gb", args.weights_gb), ("--batch", args.batch)):
            if value is not None:
                raise ValueError(f"{flag} sizes the decode step: add --bandwidth-tbs")
    preset = PRESETS[args.model] if args.model else None
    if preset is not None and args.tokens is not None and args.tokens > preset.context:
        raise ValueError(
            f"--tokens {args.tokens:,} is past {preset.name}'s context of {preset.context:,} "
            f"tokens: give at most {preset.context:,} (or drop --model and give the shape)"
        )
    weights = args.weights_gb
    if weights is None and preset is None and args.bandwidth_tbs is not None:
        # Every step reads the weights: a step of the cache alone is no floor a model has.
        raise ValueError(
            "--bandwidth-tbs bounds a step that reads the weights too: give --weights-gb "
            "(or --model)"
        )
    if weights is None and preset is not None and args.bandwidth_tbs is not None:
        # A window changes no weight; a layer count or a head's shape changes the model's.
        changed = [field for field in shape_changes(args) if field in SHAPE_FLAGS]
        if changed:  # the preset's parameter count is no longer this model's
            flag = "--" + changed[0].replace("_", "-")
            raise ValueError(
                f"{flag} changes {preset.name}'s shape, so its weights are not the preset's: "
                "give --weights-gb"
            )
        weights = preset.params_b * 2
    window = args.window
    if window is None and preset is not None:
        window = preset.sliding_window
    return KVQuery(
        layers=_shape_value(args.layers, preset, "layers"),
        kv_heads=_shape_value(args.kv_heads, preset, "kv_heads"),
        head_dim=_shape_value(args.head_dim, preset, "head_dim"),
        tokens=_shape_value(args.tokens, preset, "tokens"),
        dtype=args.dtype,
        sliding_window=window,
        memory_gib=args.memory_gib,
        weights_gb=weights,
        bandwidth_tbs=args.bandwidth_tbs,
        batch=1 if args.batch is None else args.batch,
        block_size=args.block_size,
    )


def run(args: argparse.Namespace) -> int:
    try:
        query = query_from_args(args)
    except ValueError as exc:
        print(f"replystream kv: {exc}", file=sys.stderr)
        return 2
    result = kv_sizes(query)
    changed = shape_changes(args)
    if args.model:
        # The preset as used: its published shape, with what the options changed (named).
        result["model"] = {**asdict(PRESETS[args.model]), **changed, "changed": sorted(changed)}
    if args.json:
        print(json.dumps(result))
    else:
        if args.model:
            edits = ", ".join(
                f"{field.replace('_', ' ')} {value}" for field, value in changed.items()
            )
            shape = f"published shape but {edits}" if edits else "published shape"
            print(f"model: {args.model} ({shape}; weights assume bf16 when not given)")
        print(render(result))
    return 0
