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

MAX_SEED = (1 << 63) - 1  # the largest seed a request may give (the APIs' 0..2^63-1)


def fresh_seed() -> int:
    """A seed in [0, MAX_SEED] from the operating system's randomness."""
    return secrets.randbelow(MAX_SEED + 1)


def settled_seed(given: int | None, configured: int | None) -> int:
    """The seed a reply is sampled with: ``given`` (the request's), else ``configured`` (the
    engine's), else a fresh one."""
    if given is not None:
        return given
    return fresh_seed() if configured is None else configured
