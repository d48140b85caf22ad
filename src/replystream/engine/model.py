"""A small decoder-only transformer in NumPy: prefill and decode against a KV cache.

This file decides the model's arithmetic: token embedding, RMSNorm, rotary position embeddings
(the "rotate half" convention), grouped-query attention, a SwiGLU MLP and a tied unembedding,
with parameter names in Hugging Face's Llama layout (``scripts/train_model.py`` trains it).
One ``forward`` call runs a batch of chunks: a chunk of many tokens is a prefill (causal over
the cached prefix plus the chunk, taken in blocks of keys with a running max and sum), a chunk
of one token is a decode step; all chunks share the projections and the MLP, and decode chunks
share one padded attention. The cache is asked once per call for every layer's indices
(``KVStore.step``), so no layer loops over sequences. It must not know how cache memory is laid
out (``KVStore`` hides that), nor about scheduling, sampling or text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]

_DTYPES = {"F32": np.float32, "F16": np.float16}
# Keys per block of the prefill attention: a 256-query chunk's scores for one block, over the
# 9 heads of SmolLM2, are 9 x 256 x 512 float32 = 4.5 MiB (the whole 4,096-token prefix: 36).
KEY_BLOCK = 512
# Rows of the rotary table made at load (for SmolLM2's 64 dims: 2 MiB), grown on demand past.
ROTARY_ROWS = 4096


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the model (``config.json`` beside the weights)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    context: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_json(cls, path: Path) -> ModelConfig:
        return cls(**json.loads(path.read_text(encoding="utf-8")))


class KVStep(Protocol):
    """One forward pass's access to the cache, its index arithmetic done once for all layers."""

    def write(self, layer: int, k: F32, v: F32) -> None:
        """Store the step's new keys and values (rows, kv heads, head dim), chunks in order."""
        ...

    def read(self, layer: int, group: int) -> tuple[F32, F32]:
        """Keys and values of read group ``group``: (sequences, longest, kv heads, head dim).

        Row ``b`` holds its sequence's positions ``0..start+count-1``; past them, padding
        (finite values, masked by the caller)."""
        ...


class KVStore(Protocol):
    """Where sequences' keys and values live between steps (paged or contiguous)."""

    def step(
        self, spans: Sequence[tuple[int, int, int]], groups: Sequence[Sequence[int]]
    ) -> KVStep:
        """Prepare a forward pass: ``spans[i]`` is chunk ``i``'s (seq_id, start, new tokens),
        ``groups`` the chunk indices whose caches are read together, padded to the longest."""
        ...


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one sequence to run this step, the first at absolute position ``start``."""

    seq_id: int
    tokens: tuple[int, ...]
    start: int


def load_safetensors(path: Path) -> dict[str, F32]:
    """Tensors of a ``.safetensors`` file as float32 arrays (u64 header size, JSON, raw data)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    tensors: dict[str, F32] = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        raw = np.frombuffer(
            data,
            dtype=dtype,
            count=(end - begin) // np.dtype(dtype).itemsize,
            offset=8 + size + begin,
        )
        tensors[name] = raw.reshape(info["shape"]).astype(np.float32)
    return tensors


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    variance = np.mean(x * x, axis=-1, keepdims=True)  # (..., 1)
    out: F32 = x / np.sqrt(variance + np.float32(eps)) * weight
    return out


def rms_scaled(x: F32, eps: float) -> F32:
    """RMSNorm without its gain, which is folded into the matrix that follows (see ``_Layer``).

    ``ufunc.reduce`` and in-place steps: a decode step calls this 60 times on a few rows, where
    ``np.mean``'s Python-level bookkeeping cost more than the arithmetic."""
    scale = np.add.reduce(x * x, axis=-1, keepdims=True)  # (..., 1)
    scale *= np.float32(1 / x.shape[-1])
    scale += np.float32(eps)
    np.sqrt(scale, out=scale)
    return (x / scale).astype(np.float32, copy=False)


def rotate(x: F32, cos: F32, sin: F32) -> F32:
    """Rotary embedding of ``x`` (tokens, heads, head dim); cos/sin are (tokens, 1, head dim)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate((-x[..., half:], x[..., :half]), axis=-1)
    return x * cos + rotated * sin


def softmax(scores: F32) -> F32:
    """Stable softmax over the last axis (the max is subtracted; masked entries are -inf)."""
    shifted = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    out: F32 = e / e.sum(axis=-1, keepdims=True)
    return out


@dataclass(frozen=True, slots=True)
class _Layer:
    # Matrices are (out features, in features), as trained, applied as ``x @ w.T``: at small
    # batches OpenBLAS runs that "NT" product up to twice as fast as ``x @ w`` on (in, out).
    # The RMSNorm gain g before a matrix is folded into its columns at load, since
    # (x / rms * g) @ w.T == (x / rms) @ (w * g).T: two fewer passes per layer.
    wqkv: F32  # ((heads + 2 kv heads) * head dim, d_model): q, k, v stacked, times attn gain
    wo: F32  # (d_model, heads * head dim)
    w_gate_up: F32  # (2 * d_ff, d_model): gate and up stacked, times the MLP norm's gain
    w_down: F32  # (d_model, d_ff)


class TinyModel:
    """The transformer's weights and its forward pass."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, F32]) -> None:
        c = self.config = config
        self.embed = weights["model.embed_tokens.weight"]  # (vocab, d_model)
        lm_head = weights.get("lm_head.weight")  # None: tied to the embedding, held once
        self.unembed = self.embed if lm_head is None else np.ascontiguousarray(lm_head)
        self.final_norm = weights["model.norm.weight"]  # (d_model,)
        self.layers: list[_Layer] = []
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            qkv = [weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            gate_up = [weights[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
            attn_gain = weights[p + "input_layernorm.weight"][None, :]  # (1, d_model)
            mlp_gain = weights[p + "post_attention_layernorm.weight"][None, :]
            self.layers.append(
                _Layer(
                    wqkv=np.ascontiguousarray(np.concatenate(qkv) * attn_gain),
                    wo=np.ascontiguousarray(weights[p + "self_attn.o_proj.weight"]),
                    w_gate_up=np.ascontiguousarray(np.concatenate(gate_up) * mlp_gain),
                    w_down=np.ascontiguousarray(weights[p + "mlp.down_proj.weight"]),
                )
            )
        D = c.head_dim
        self._inv_freq = 1.0 / c.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
        self._rotary = self._rotary_table(min(c.context, ROTARY_ROWS))  # (rows, D) each

    def _rotary_table(self, rows: int) -> tuple[F32, F32]:
        """cos and sin of positions ``0..rows-1`` (rows, head dim), in the rotate-half layout."""
        angles = np.outer(np.arange(rows), self._inv_freq)  # (rows, D/2), float64
        angles = np.concatenate((angles, angles), axis=-1)  # (rows, D)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def _rotation(self, pos: NDArray[np.int64]) -> tuple[F32, F32]:
        """cos and sin at positions ``pos`` (N,), each (N, 1, head dim).

        The table grows (doubling, up to the context) to the furthest position run so far,
        not to the context the weights claim: what a position costs is paid only by a
        sequence the KV pool let reach it, and a file claiming 2^32 positions loads in the
        memory of one that claims 2,048. Growing swaps the (cos, sin) pair whole, so a
        reader never sees one table grown and the other not."""
        cos, sin = self._rotary
        furthest = int(pos.max()) if pos.size else -1
        if furthest >= len(cos):
            rows = min(self.config.context, max(furthest + 1, 2 * len(cos)))
            cos, sin = self._rotary = self._rotary_table(rows)
        return cos[pos][:, None, :], sin[pos][:, None, :]

    @classmethod
    def load(cls, directory: Path) -> TinyModel:
        """Load ``config.json`` and ``model.safetensors`` from ``directory``."""
        config = ModelConfig.from_json(directory / "config.json")
        return cls(config, load_safetensors(directory / "model.safetensors"))

    @property
    def parameter_count(self) -> int:
        """Parameters as trained (the tied unembedding counted once)."""
        c = self.config
        per_layer = sum(w.size for w in (self.layers[0].wqkv, self.layers[0].wo))
        per_layer += self.layers[0].w_gate_up.size + self.layers[0].w_down.size + 2 * c.d_model
        return int(self.embed.size + c.n_layers * per_layer + c.d_model)

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads for the weights (embedding rows aside)."""
        arrays = [self.unembed, self.final_norm]
        for w in self.layers:
            arrays += [w.wqkv, w.wo, w.w_gate_up, w.w_down]
        return sum(a.nbytes for a in arrays)

    def _qkv(self, w: _Layer, x: F32, cos: F32, sin: F32) -> tuple[F32, F32, F32]:
        """Rotated queries and keys, and values; cos/sin are (tokens, 1, head dim)."""
        c = self.config
        N, H, KV, D = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
        qkv = rms_scaled(x, c.norm_eps) @ w.wqkv.T  # (tokens, (H + 2 KV) * D)
        qk = rotate(qkv[:, : (H + KV) * D].reshape(N, H + KV, D), cos, sin)  # one pass for both
        v = qkv[:, (H + KV) * D :].reshape(N, KV, D)  # (tokens, kv heads, head dim)
        return qk[:, :H], qk[:, H:], v  # (tokens, heads, D), (tokens, kv heads, D), the same

    def _mlp(self, w: _Layer, x: F32) -> F32:
        h = rms_scaled(x, self.config.norm_eps) @ w.w_gate_up.T  # (tokens, 2 d_ff)
        d_ff = self.config.d_ff
        gate, up = h[:, :d_ff], h[:, d_ff:]  # (tokens, d_ff) each
        # silu(gate) * up = gate * sigmoid(gate) * up, with sigmoid(x) = (1 + tanh(x / 2)) / 2
        # (no overflow for any x), in place in one array: a 256-token chunk's five temporaries
        # cost 6x the time of the arithmetic.
        act = np.multiply(gate, np.float32(0.5))
        np.tanh(act, out=act)
        act *= np.float32(0.5)
        act += np.float32(0.5)
        act *= gate
        act *= up
        out: F32 = act @ w.w_down.T  # (tokens, d_model)
        return out

    def _attend(self, q: F32, k: F32, v: F32, mask: NDArray[np.bool_]) -> F32:
        """Attention of queries (B, T, H, D) over keys/values (B, L, KV, D); mask (B, T, L)."""
        c = self.config
        B, T, H, D = q.shape
        KV, G = c.n_kv_heads, c.n_heads // c.n_kv_heads
        qg = q.reshape(B, T, KV, G, D).transpose(0, 2, 3, 1, 4)  # (B, kv heads, group, T, D)
        kt = k.transpose(0, 2, 3, 1)[:, :, None]  # (B, kv heads, 1, D, L)
        scores = (qg @ kt) / np.float32(np.sqrt(D))  # (B, kv heads, group, T, L)
        scores = np.where(mask[:, None, None], scores, np.float32(-np.inf))
        vg = v.transpose(0, 2, 1, 3)[:, :, None]  # (B, kv heads, 1, L, D)
        out = softmax(scores) @ vg  # (B, kv heads, group, T, D)
        return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)  # query head = kv head * G + g

    def forward(
        self, chunks: Sequence[Chunk], cache: KVStore, last: Sequence[int] | None = None
    ) -> F32:
        """Run every chunk through the model, store its keys/values, return next-token logits.

        ``last[i]`` asks for the logits of chunk ``i``'s last ``last[i]`` positions (1 when
        ``last`` is None); a speculative step verifies its draft with them.

        Returns:
            (sum(last), vocab) logits, chunk by chunk, positions in order.
        """
        c = self.config
        lengths = [len(ch.tokens) for ch in chunks]
        ends = np.cumsum(lengths)  # (chunks,) one past each chunk's last row
        ids = np.fromiter((t for ch in chunks for t in ch.tokens), dtype=np.int64)  # (N,)
        starts = [ch.start for ch in chunks]
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
        if pos.max() >= c.context:
            raise ValueError(f"position {pos.max()} is beyond the context of {c.context}")
        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefills = [i for i, n in enumerate(lengths) if n > 1]
        # Read group 0 is every decode chunk (one padded attention), then one per prefill.
        groups = ([decode] if decode else []) + [[i] for i in prefills]
        spans = [(ch.seq_id, ch.start, n) for ch, n in zip(chunks, lengths, strict=True)]
        kv = cache.step(spans, groups)
        cos, sin = self._rotation(pos)  # (N, 1, head dim) each
        rows_d = ends[decode] - 1  # (B,) rows of the decode chunks
        seen = np.array([chunks[i].start + 1 for i in decode], dtype=np.int64)  # (B,)
        longest = int(seen.max()) if decode else 0
        hidden = np.arange(longest)[None, :] >= seen[:, None]  # (B, longest) padding
        bias = np.where(hidden, np.float32(-np.inf), np.float32(0))  # (B, longest)
        x = self.embed[ids]  # (N, d_model)
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, cos, sin)  # (N, H, D), (N, KV, D), (N, KV, D)
            kv.write(layer, k, v)
            if len(decode) == len(chunks):  # a decode-only step: every row is a decode row
                k_d, v_d = kv.read(layer, 0)  # (B, longest, KV, D)
                att = self._decode_attend(q, k_d, v_d, bias)
            else:
                att = np.empty(q.shape, np.float32)  # (N, heads, head dim)
            if decode and len(decode) < len(chunks):
                k_d, v_d = kv.read(layer, 0)
                att[rows_d] = self._decode_attend(q[rows_d], k_d, v_d, bias)
            for group, i in enumerate(prefills, start=len(groups) - len(prefills)):
                rows = slice(ends[i] - lengths[i], ends[i])
                k_p, v_p = kv.read(layer, group)  # (1, start + T, KV, D)
                att[rows] = self._prefill_attend(q[rows], k_p[0], v_p[0], chunks[i].start)
            x = x + att.reshape(len(ids), -1) @ w.wo.T  # (N, d_model)
            x = x + self._mlp(w, x)
        if last is None:
            wanted = ends - 1  # (chunks,)
        else:
            wanted = np.concatenate([np.arange(e - n, e) for e, n in zip(ends, last, strict=True)])
        h = rms_norm(x[wanted], self.final_norm, c.norm_eps)  # (rows, d_model)
        return (h @ self.unembed.T).astype(np.float32, copy=False)  # (rows, vocab)

    def prefill(self, seq_id: int, tokens: Sequence[int], cache: KVStore) -> F32:
        """Run a whole prompt in one pass, fill its cache; the next token's logits (vocab,)."""
        logits: F32 = self.forward([Chunk(seq_id, tuple(tokens), 0)], cache)[0]
        return logits

    def decode(self, chunks: Sequence[Chunk], cache: KVStore) -> F32:
        """One new token per sequence against its cache: (sequences, vocab) logits."""
        if any(len(ch.tokens) != 1 for ch in chunks):
            raise ValueError("decode takes exactly one token per sequence")
        return self.forward(chunks, cache)

    def _decode_attend(self, q: F32, k: F32, v: F32, bias: F32) -> F32:
        """One query per sequence (B, H, D) over its padded cache (B, L, KV, D); ``bias``
        (B, L) is 0 on a sequence's positions and -inf on its padding."""
        c = self.config
        B, H, D = q.shape
        KV, G = c.n_kv_heads, c.n_heads // c.n_kv_heads
        qg = q.reshape(B, KV, G, D) * np.float32(1 / np.sqrt(D))  # query head = kv * G + g
        scores = qg @ k.transpose(0, 2, 3, 1)  # (B, KV, G, L)
        scores += bias[:, None, None, :]
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = (scores @ v.transpose(0, 2, 1, 3)).reshape(B, H, D)  # from (B, KV, G, D)
        return out.astype(np.float32, copy=False)

    def _prefill_attend(self, q: F32, k: F32, v: F32, start: int) -> F32:
        """A chunk's queries (T, H, D) at positions ``start..``, causal, over keys and values
        (start + T, KV, D): blocks of ``KEY_BLOCK`` keys with a running max and sum, so no
        (queries x whole prefix) score matrix is ever held and only the blocks that reach past
        a query's position are masked."""
        c = self.config
        T, H, D = q.shape
        KV, G = c.n_kv_heads, c.n_heads // c.n_kv_heads
        total = start + T
        scale = np.float32(1 / np.sqrt(D))
        # (KV, G * T, D): each kv head's whole group of query heads as the rows of one matmul.
        qh = (q.reshape(T, KV, G, D).transpose(1, 2, 0, 3) * scale).reshape(KV, G * T, D)
        kh, vh = k.transpose(1, 2, 0), v.transpose(1, 0, 2)  # (KV, D, total), (KV, total, D)
        query_pos = np.arange(start, total)  # (T,)
        acc = np.zeros((KV, G * T, D), np.float32)  # weighted values so far
        mass = np.zeros((KV, G * T, 1), np.float32)  # softmax denominators so far
        peak = np.full((KV, G * T, 1), -np.inf, np.float32)  # largest score so far
        for b0 in range(0, total, KEY_BLOCK):
            b1 = min(b0 + KEY_BLOCK, total)
            scores = qh @ kh[:, :, b0:b1]  # (KV, G * T, n)
            if b1 - 1 > start:  # a key of this block comes after some query: mask it
                future = np.arange(b0, b1)[None, :] > query_pos[:, None]  # (T, n)
                view = scores.reshape(KV, G, T, b1 - b0)
                view += np.where(future, np.float32(-np.inf), np.float32(0))
            # Block 0 holds key 0, seen by every query, so the peak is finite from then on.
            new_peak = np.maximum(peak, scores.max(axis=-1, keepdims=True))
            scores -= new_peak
            np.exp(scores, out=scores)
            shrink = np.exp(peak - new_peak)  # rescales the earlier blocks (0 at block 0)
            acc *= shrink
            acc += scores @ vh[:, b0:b1]
            mass *= shrink
            mass += scores.sum(axis=-1, keepdims=True)
            peak = new_peak
        out = (acc / mass).reshape(KV, G, T, D).transpose(2, 0, 1, 3).reshape(T, H, D)
        return out.astype(np.float32, copy=False)

    def full_logits(self, tokens: Sequence[int]) -> F32:
        """Logits at every position, recomputed from scratch with no cache (a reference)."""
        c = self.config
        T = len(tokens)
        pos = np.arange(T)
        x = self.embed[np.asarray(tokens, dtype=np.int64)]  # (T, d_model)
        causal = (pos[None, :] <= pos[:, None])[None]  # (1, T, T)
        cos, sin = self._rotation(pos)  # (T, 1, head dim) each
        for w in self.layers:
            q, k, v = self._qkv(w, x, cos, sin)
            att = self._attend(q[None], k[None], v[None], causal)[0]  # (T, heads, head dim)
            x = x + att.reshape(T, -1) @ w.wo.T
            x = x + self._mlp(w, x)
        logits: F32 = rms_norm(x, self.final_norm, c.norm_eps) @ self.unembed.T  # (T, vocab)
        return logits
