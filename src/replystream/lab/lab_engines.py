"""Which engine ``lab-engine`` measures: the tiny model, SmolLM2, or a GGUF file.

This file decides the grammar of ``lab-engine --engine`` (``tiny``, ``smollm2``, ``gguf:PATH``;
none given: the engine ``serve`` would serve, so the lab measures what a user runs) and loads
the model once: each experiment then builds fresh engines of the capacity it needs (a pool
size, a batch limit, speculation on or off) around the same weights, so a 500 MiB model is not
read and dequantised again per experiment. It also holds each model's default experiment sizes:
the tiny model's context is 256 tokens, SmolLM2's 8,192, and a step of SmolLM2 costs some 40
times the tiny one's. It must not know what the experiments measure.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replystream.engine.smollm2_weights import SMOLLM2_INSTALL, smollm2_path
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server.engine_options import default_engine

if TYPE_CHECKING:
    from replystream.engine.tiny import TinyEngine

ENGINE_CHOICES = "tiny, smollm2 or gguf:PATH"


@dataclass(frozen=True, slots=True)
class Sizes:
    """An experiment's default sizes for one model (each has a flag to override it)."""

    ttft_lengths: tuple[int, ...]
    repeats: int  # ttft: runs per length; step: rounds over the batches; spec: runs per mode
    step_batches: tuple[int, ...]
    tokens: int  # step, pool, spec: tokens per reply


TINY_SIZES = Sizes((8, 32, 64, 128, 192, 255), 5, (1, 2, 4, 8, 16, 32), 64)
# Prefill of 4,096 tokens takes about a minute on one core: one run per length by default.
GGUF_SIZES = Sizes((64, 256, 1024, 2048, 4096), 1, (1, 2, 4, 8, 16, 32), 32)


@dataclass(frozen=True, slots=True)
class LabEngine:
    """A loaded model, and how to build an engine of a given capacity around it."""

    name: str  # "tiny", "smollm2" or the GGUF file's name: it labels tables and PNG files
    config: TinyEngineConfig  # the capacity ``serve`` would give this model
    sizes: Sizes
    context: int
    load_seconds: float
    _build: Callable[[TinyEngineConfig], TinyEngine]

    def engine(self, **changes: Any) -> TinyEngine:
        """A fresh engine: this model with ``config`` changed by ``changes`` (its fields)."""
        return self._build(replace(self.config, **changes))


def plot_name(stem: str, model: str) -> str:
    """A plot's file name: ``engine-ttft.png`` for the tiny model, else with the model's name."""
    return f"{stem}.png" if model == "tiny" else f"{stem}-{model}.png"


def parse_lab_engine(text: str) -> str:
    """Check an ``--engine`` value (argparse type); the path of ``gguf:PATH`` must exist."""
    if text in ("tiny", "smollm2"):
        return text
    if text.startswith("gguf:") and len(text) > 5:
        if not Path(text[5:]).is_file():
            raise argparse.ArgumentTypeError(f"want {ENGINE_CHOICES}: no file {text[5:]!r}")
        return text
    raise argparse.ArgumentTypeError(f"want {ENGINE_CHOICES}, got {text!r}")


def load_lab_engine(spec: str | None, clock: Callable[[], float]) -> LabEngine:
    """Load the model ``spec`` names (None: ``serve``'s default engine).

    Raises:
        ValueError: the SmolLM2 wheel is not installed, or the GGUF cannot be run.
    """
    # The models' code (NumPy, the GGUF reader) loads here, not with the command line's
    # grammar above, so a mistake in ``lab-engine``'s flags is told without it.
    from replystream.engine.gguf_engine import (
        GGUF_ENGINE_DEFAULTS,
        load_gguf_model,
        prompt_format,
    )
    from replystream.engine.model import TinyModel
    from replystream.engine.tiny import ASSETS, TinyEngine
    from replystream.engine.tokenizer import ByteTokenizer

    spec = spec or default_engine()
    began = clock()
    if spec == "tiny":
        model = TinyModel.load(ASSETS)
        tokenizer = ByteTokenizer(ASSETS / "tokenizer.json")
        return LabEngine(
            "tiny",
            TinyEngineConfig(),
            TINY_SIZES,
            model.config.context,
            clock() - began,
            lambda config: TinyEngine(model, tokenizer, config),
        )
    if spec == "smollm2":
        path = smollm2_path()
        if path is None:
            raise ValueError(f"the SmolLM2 weights are not installed: {SMOLLM2_INSTALL}")
        name = "smollm2"
    else:
        path = Path(spec[5:])
        name = path.stem
    gguf, gguf_model, gguf_tokenizer = load_gguf_model(path)
    try:
        prompts = prompt_format(gguf, gguf_tokenizer)
    except ValueError as exc:  # its chat template, named with the file as every refusal is
        raise ValueError(f"{path}: {exc}") from None
    stops = gguf.vocabulary.stop_ids

    def build(config: TinyEngineConfig) -> TinyEngine:
        return TinyEngine(
            gguf_model, gguf_tokenizer, config, prompts=prompts, stop_tokens=stops, name=name
        )

    return LabEngine(
        name, GGUF_ENGINE_DEFAULTS, GGUF_SIZES, gguf.config.context, clock() - began, build
    )
