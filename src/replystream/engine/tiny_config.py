"""``TinyEngineConfig``: what the built-in NumPy engine may hold and do at once.

Apart from the engine (``engine.tiny``) so that ``serve``'s settings, which fill it from the
command line, are read without NumPy or the model: a wrong flag is told before either loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TinyEngineConfig:
    """Capacity of the engine: the KV pool and the step limits; the default seed."""

    num_blocks: int = 512
    block_size: int = 16
    token_budget: int = 128
    max_running: int = 32
    default_max_tokens: int = 128
    blas_threads: int | None = 1  # None leaves BLAS's own thread count
    spec_tokens: int = 0  # prompt-lookup draft tokens per step at most (0: off)
    spec_ngram: int = 3  # longest context n-gram a draft is looked up by
    seed: int | None = None  # a request without a seed samples with it (None: a fresh one each)
    prefix_caching: bool = False  # full KV blocks kept for later requests beginning alike

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.default_max_tokens) < 1:
            raise ValueError("num_blocks, block_size and default_max_tokens must be >= 1")
