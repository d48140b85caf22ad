"""Which seed a sampled reply draws with when its request gives none.

A request's own seed always wins. Without one, a model engine uses the seed its server was
started with (``serve --seed N``: reproducible runs), or else draws a fresh one from the
operating system's randomness, as OpenAI, vLLM and llama.cpp do: asking again at a
temperature above 0 makes another reply. The seed is settled once per request, before any
token is made, so every pick of that reply (a preempted sequence's recompute included) draws
from the one generator, and a request's several choices take ``seed + i`` from one draw.
It must not know about HTTP.
"""

from __future__ import annotations

import secrets

# A request's seed is a 64-bit signed integer, as OpenAI's ``seed`` (int64) and vLLM's are.
MIN_SEED = -(1 << 63)
MAX_SEED = (1 << 63) - 1
_SEEDS = 1 << 64


def fresh_seed() -> int:
    """A seed in [0, MAX_SEED] from the operating system's randomness."""
    return secrets.randbelow(MAX_SEED + 1)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed``: ``seed + index``, wrapped
    within the range a request's seed takes (so an upstream is sent a seed it accepts)."""
    return (seed + index - MIN_SEED) % _SEEDS + MIN_SEED


def generator_seed(seed: int | None) -> int | None:
    """What a NumPy generator is seeded with for a request's ``seed``: its 64 bits read as
    unsigned (the generator takes no negative seed; distinct seeds stay distinct). None
    stays None: the generator draws from the operating system."""
    return None if seed is None else seed % _SEEDS


def settled_seed(given: int | None, configured: int | None) -> int:
    """The seed a reply is sampled with: ``given`` (the request's), else ``configured`` (the
    engine's), else a fresh one."""
    if given is not None:
        return given
    return fresh_seed() if configured is None else configured
