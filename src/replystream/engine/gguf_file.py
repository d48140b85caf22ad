"""What a LLaMA-architecture GGUF file holds: the model's shape, its weights, its vocabulary.

This file decides how a GGUF's metadata becomes a ``ModelConfig`` and how its tensors become
float32 arrays under Hugging Face's Llama names, so ``model.TinyModel`` runs them unchanged:
1. ``gguf_header.py`` reads the header (the file stays memory-mapped) and the ``gguf`` package
   dequantises each tensor (F32, F16, Q8_0, Q4_0, Q4_1, the K-quants...) once, when the model
   asks for it, so the load never holds two float32 copies of every weight at once.
2. llama.cpp's converter permutes the rows of the Q and K projections so that its rotary
   embedding can rotate adjacent pairs (x0, x1), (x2, x3)...; Hugging Face's Llama rotates
   halves (x_i, x_{i+D/2}). The permutation is undone here, so the model keeps one convention.
3. Only what our model computes is accepted: the llama architecture, and metadata, tensors
   and token ids as ``gguf_checks.py`` checks them, before a weight is read. Anything else is
   refused with a ValueError that names the file and what is wrong.
It must not know about serving, tokenizers' algorithms or chat templates (it only hands over
the vocabulary, merges and template strings the file stores).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.quants import dequantize
from numpy.typing import NDArray

from replystream.engine.end_tokens import end_of_generation_ids
from replystream.engine.gguf_checks import check_tensors, check_token_ids, model_config
from replystream.engine.gguf_header import GGUFHeader, read_header
from replystream.engine.model import ModelConfig

F32 = NDArray[np.float32]

# GGUF tensor name (per block where ``{i}`` appears) -> Hugging Face Llama parameter name.
log = logging.getLogger("replystream.engine")

# LLaMA 3's pre-tokenizer names: llama.cpp begins every prompt of such a file with BOS unless
# the file says not to (``tokenizer.ggml.add_bos_token``); any other, only when it says to.
BOS_BY_DEFAULT = frozenset({"llama-bpe", "llama3", "llama-v3"})
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The tokenizer as the GGUF stores it (``tokenizer.ggml.*`` and the chat template)."""

    model: str  # "gpt2" for byte-level BPE
    pre: str  # the pre-tokenizer's name in llama.cpp ("smollm", "llama-bpe", ...)
    tokens: tuple[str, ...]
    # 1 normal, 3 control, 4 user-defined (llama.cpp's values), one per token; empty when the
    # file gives none. The loader's own copy, not a view of the file.
    token_types: NDArray[np.int32]
    merges: tuple[str, ...]
    bos_id: int | None
    add_bos: bool  # every prompt begins with BOS (``tokenizer.ggml.add_bos_token``)
    eos_id: int | None
    # End of generation: EOS, EOT and EOM where the file names them, and the known end
    # tokens its vocabulary holds (``end_tokens``).
    stop_ids: frozenset[int]
    chat_template: str | None


class _Weights(Mapping[str, F32]):
    """Hugging Face names -> float32 arrays, each dequantised when it is asked for."""

    def __init__(self, header: GGUFHeader, config: ModelConfig) -> None:
        self._tensors = {t.name: t for t in header.tensors}
        self._config = config
        self._gguf_name: dict[str, str] = {}
        for gguf_name, hf_name in _NAMES.items():
            for i in range(config.n_layers) if "{i}" in gguf_name else [0]:
                if gguf_name.format(i=i) in self._tensors:
                    self._gguf_name[hf_name.format(i=i)] = gguf_name.format(i=i)

    def __getitem__(self, name: str) -> F32:
        tensor = self._tensors[self._gguf_name[name]]
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        # Damaged blocks (an infinite scale times a zero) make NaN: refused just below, by
        # name, without NumPy's warning lines before the one line of the refusal.
        with np.errstate(invalid="ignore", over="ignore"):
            w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape(shape)  # (out features, in features) for a matrix, as in PyTorch
        if not w.flags.writeable:
            # A float32 tensor comes back as a view of the file's read-only mapping: held as
            # it is, each step would read the file, and a file cut short while serving (copied
            # over in place) would kill the process by SIGBUS. The model holds its own copy.
            w = w.copy()
        # One NaN or infinity makes every logit NaN from the first token on (and a NaN log
        # probability is no JSON): refused here, while the file is being loaded. A pass over
        # the float32 copy: about 30 ms on SmolLM2's 135M weights, once.
        if not np.isfinite(w).all():
            raise ValueError(f"tensor {tensor.name} holds values that are not finite numbers")
        c = self._config
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, c.n_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, c.n_kv_heads)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._gguf_name)

    def __len__(self) -> int:
        return len(self._gguf_name)


def unpermute_rope_rows(w: F32, heads: int) -> F32:
    """Undo llama.cpp's Q/K row order (pairs) back to Hugging Face's (halves), per head.

    llama.cpp's converter does ``w.reshape(heads, 2, D/2, in).swapaxes(1, 2)``; this is its
    inverse.
    """
    rows, cols = w.shape
    half = rows // heads // 2
    out: F32 = w.reshape(heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    return out


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """An opened GGUF: the shape, lazily dequantised weights, and the vocabulary."""

    path: Path
    name: str
    config: ModelConfig
    weights: Mapping[str, F32]
    vocabulary: Vocabulary
    file_bytes: int


def _field(header: GGUFHeader, key: str, default: Any = None) -> Any:
    return header.fields.get(key, default)


def _texts(header: GGUFHeader, key: str) -> tuple[str, ...]:
    """An array of strings (empty when the key is absent).

    Raises:
        ValueError: the key holds something else (a number, an array of numbers).
    """
    value = _field(header, key, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{key} is not an array of text")
    return tuple(value)


def _token_types(header: GGUFHeader) -> NDArray[np.int32]:
    """``tokenizer.ggml.token_type`` as the loader's own int32 array (empty when absent).

    The header's array is a view of the file's mapping: copied, so nothing kept after the load
    reads the file (a file cut short while serving would end the process by SIGBUS).

    Raises:
        ValueError: the key holds something else than whole numbers that fit an int32.
    """
    value = _field(header, "tokenizer.ggml.token_type")
    if value is None:
        return np.zeros(0, np.int32)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
        raise ValueError("tokenizer.ggml.token_type is not an array of whole numbers")
    limits = np.iinfo(np.int32)
    if value.size and (value.min() < limits.min or value.max() > limits.max):
        raise ValueError("tokenizer.ggml.token_type holds numbers no token type is")
    return value.astype(np.int32)  # a copy, always (a new dtype or not)


def open_gguf(path: Path) -> GGUFModel:
    """Read ``path``'s metadata and map its tensors (nothing is dequantised yet).

    Raises:
        ValueError: not a GGUF, or a model this engine does not compute (named).
    """
    try:
        reader = read_header(path)
    except OSError as exc:  # as every file the command line names is told (no errno, no repr)
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}; this engine runs 'llama' models")

    try:
        tokens = _texts(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("no tokenizer.ggml.tokens: the file holds no vocabulary")
        config = model_config(reader.fields, len(tokens))
        check_tensors(reader.tensors, config)
        ids = {
            key: _field(reader, f"tokenizer.ggml.{key}_token_id")
            for key in ("bos", "eos", "eot", "eom")
        }
        check_token_ids(ids, len(tokens))
        types = _token_types(reader)
        if types.size and types.size != len(tokens):
            raise ValueError(f"{types.size} token types for {len(tokens)} tokens")
        merges = _texts(reader, "tokenizer.ggml.merges")
        pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
        if "tokenizer.ggml.pre" not in reader.fields:
            # Older converters wrote none; llama.cpp then splits text its own default way, and
            # warns that the model may not have been trained on that split. So do we.
            log.warning(
                "%s: no tokenizer.ggml.pre: its text is split as GPT-2 splits it, which may "
                "not be how the model was trained (a newer conversion of it names one)",
                path,
            )
        add_bos = _field(reader, "tokenizer.ggml.add_bos_token", pre in BOS_BY_DEFAULT)
        if not isinstance(add_bos, bool):
            raise ValueError("tokenizer.ggml.add_bos_token is not true or false")
        if add_bos and ids["bos"] is None:
            raise ValueError("tokenizer.ggml.add_bos_token asks for a BOS the file does not name")
        template = _field(reader, "tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ValueError("tokenizer.chat_template is not text")
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    spelt = {text: index for index, text in reversed(list(enumerate(tokens)))}  # first id wins
    stop_ids = end_of_generation_ids((ids[k] for k in ("eos", "eot", "eom")), spelt)
    vocabulary = Vocabulary(
        model=str(_field(reader, "tokenizer.ggml.model", "")),
        pre=pre,
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=ids["bos"],
        add_bos=add_bos,
        eos_id=ids["eos"],
        stop_ids=stop_ids,
        chat_template=template,
    )
    weights = _Weights(reader, config)
    given = _field(reader, "general.name")
    name = given if isinstance(given, str) and given else path.stem
    return GGUFModel(path, name, config, weights, vocabulary, path.stat().st_size)
