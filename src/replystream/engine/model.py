"""A small decoder-only transformer in NumPy: prefill and decode against a KV cache.

This file decides the model's arithmetic: token embedding, RMSNorm, rotary position embeddings
(the "rotate half" convention), grouped-query attention, a SwiGLU MLP and a tied unembedding,
with parameter names in Hugging Face's Llama layout (``scripts/train_model.py`` trains it).
One ``forward`` call runs a batch of chunks: a chunk of many tokens is a prefill (causal mask
over the cached prefix plus the chunk), a chunk of one token is a decode step; all chunks share
the projections and the MLP, and decode chunks share one padded attention. It must not know how
cache memory is laid out (``KVStore`` hides that), nor about scheduling, sampling or text.
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


class KVStore(Protocol):
    """Where a sequence's keys and values live between steps (paged or contiguous)."""

    def write(self, layer: int, seq_id: int, start: int, k: F32, v: F32) -> None:
        """Store ``k``, ``v`` (time, kv heads, head dim) at positions ``start...``."""
        ...

    def read(self, layer: int, seq_id: int, length: int) -> tuple[F32, F32]:
        """Keys and values of positions ``0..length-1``: (length, kv heads, head dim) each."""
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
    attn_norm: F32  # (d_model,)
    # Matrices are (out features, in features), as trained, applied as ``x @ w.T``: at small
    # batches OpenBLAS runs that "NT" product up to twice as fast as ``x @ w`` on (in, out).
    wqkv: F32  # ((heads + 2 kv heads) * head dim, d_model): q, k, v projections stacked
    wo: F32  # (d_model, heads * head dim)
    mlp_norm: F32  # (d_model,)
    w_gate_up: F32  # (2 * d_ff, d_model): gate and up projections stacked
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
            self.layers.append(
                _Layer(
                    attn_norm=weights[p + "input_layernorm.weight"],
                    wqkv=np.ascontiguousarray(np.concatenate(qkv)),
                    wo=np.ascontiguousarray(weights[p + "self_attn.o_proj.weight"]),
                    mlp_norm=weights[p + "post_attention_layernorm.weight"],
                    w_gate_up=np.ascontiguousarray(np.concatenate(gate_up)),
                    w_down=np.ascontiguousarray(weights[p + "mlp.down_proj.weight"]),
                )
            )
        D = c.head_dim
        inv_freq = 1.0 / c.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)  # (D/2,)
        angles = np.outer(np.arange(c.context), inv_freq)  # (context, D/2)
        angles = np.concatenate((angles, angles), axis=-1)  # (context, D)
        self.cos = np.cos(angles).astype(np.float32)
        self.sin = np.sin(angles).astype(np.float32)

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
            arrays += [w.attn_norm, w.wqkv, w.wo, w.mlp_norm, w.w_gate_up, w.w_down]
        return sum(a.nbytes for a in arrays)

    def _qkv(self, w: _Layer, x: F32, pos: NDArray[np.int64]) -> tuple[F32, F32, F32]:
        c = self.config
        N, H, KV, D = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
        qkv = rms_norm(x, w.attn_norm, c.norm_eps) @ w.wqkv.T  # (tokens, (H + 2 KV) * D)
        q = qkv[:, : H * D].reshape(N, H, D)  # (tokens, heads, head dim)
        k = qkv[:, H * D : (H + KV) * D].reshape(N, KV, D)  # (tokens, kv heads, head dim)
        v = qkv[:, (H + KV) * D :].reshape(N, KV, D)  # (tokens, kv heads, head dim)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # (tokens, 1, head dim)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _mlp(self, w: _Layer, x: F32) -> F32:
        h = rms_norm(x, w.mlp_norm, self.config.norm_eps) @ w.w_gate_up.T  # (tokens, 2 d_ff)
        gate, up = np.split(h, 2, axis=-1)  # (tokens, d_ff) each
        silu = gate * (0.5 + 0.5 * np.tanh(0.5 * gate))  # x * sigmoid(x), no overflow for any x
        out: F32 = (silu * up) @ w.w_down.T  # (tokens, d_model)
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
        x = self.embed[ids]  # (N, d_model)
        for layer, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, pos)  # (N, H, D), (N, KV, D), (N, KV, D)
            att = np.empty_like(q)  # (N, heads, head dim)
            for i, ch in enumerate(chunks):
                rows = slice(ends[i] - lengths[i], ends[i])
                cache.write(layer, ch.seq_id, ch.start, k[rows], v[rows])
            for i, ch in enumerate(chunks):
                if lengths[i] > 1:
                    rows = slice(ends[i] - lengths[i], ends[i])
                    att[rows] = self._prefill_attention(layer, ch, q[rows], cache)
            if decode:
                rows_d = ends[decode] - 1  # (B,)
                att[rows_d] = self._decode_attention(
                    layer, [chunks[i] for i in decode], q[rows_d], cache
                )
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

    def _prefill_attention(self, layer: int, chunk: Chunk, q: F32, cache: KVStore) -> F32:
        """A chunk's queries (T, H, D), causal within the chunk, over all of its cached prefix."""
        total = chunk.start + len(chunk.tokens)
        k, v = cache.read(layer, chunk.seq_id, total)  # (total, kv heads, head dim)
        query_pos = np.arange(chunk.start, total)  # (T,)
        causal = np.arange(total)[None, :] <= query_pos[:, None]  # (T, total)
        out: F32 = self._attend(q[None], k[None], v[None], causal[None])[0]  # (T, heads, head dim)
        return out

    def _decode_attention(self, layer: int, chunks: Sequence[Chunk], q: F32, cache: KVStore) -> F32:
        """One new query per sequence against its cache, padded to the longest: (B, H, D)."""
        c = self.config
        B, L = len(chunks), max(ch.start for ch in chunks) + 1
        k = np.zeros((B, L, c.n_kv_heads, c.head_dim), np.float32)  # (B, L, kv heads, head dim)
        v = np.zeros_like(k)
        for b, ch in enumerate(chunks):
            k[b, : ch.start + 1], v[b, : ch.start + 1] = cache.read(layer, ch.seq_id, ch.start + 1)
        lengths = np.array([ch.start + 1 for ch in chunks])  # (B,)
        mask = (np.arange(L)[None, :] < lengths[:, None])[:, None, :]  # (B, 1, L)
        return self._attend(q[:, None], k, v, mask)[:, 0]  # (B, heads, head dim)

    def full_logits(self, tokens: Sequence[int]) -> F32:
        """Logits at every position, recomputed from scratch with no cache (a reference)."""
        c = self.config
        T = len(tokens)
        pos = np.arange(T)
        x = self.embed[np.asarray(tokens, dtype=np.int64)]  # (T, d_model)
        causal = (pos[None, :] <= pos[:, None])[None]  # (1, T, T)
        for w in self.layers:
            q, k, v = self._qkv(w, x, pos)
            att = self._attend(q[None], k[None], v[None], causal)[0]  # (T, heads, head dim)
            x = x + att.reshape(T, -1) @ w.wo.T
            x = x + self._mlp(w, x)
        logits: F32 = rms_norm(x, self.final_norm, c.norm_eps) @ self.unembed.T  # (T, vocab)
        return logits
