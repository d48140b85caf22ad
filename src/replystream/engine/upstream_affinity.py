"""Which upstream a request prefers when the relay routes by prefix (``--upstream-routing
prefix``): the one whose prompt cache most likely holds the start of its prompt.

A model server with prefix caching (vLLM's automatic prefix caching, SGLang's radix cache,
llama.cpp's slots) skips the prefill of a prompt's start it has seen; spread over replicas by
load alone, a conversation's turns land on different ones and each turn pays for its whole
history again. This file decides:
- the request's affinity key: the client's own ``prompt_cache_key`` (OpenAI's field for
  exactly this) when it gave one; else the start of what a conversation keeps from turn to
  turn, its instructions and first user message (up to ``KEY_CHARS``), so every turn of one
  conversation has one key; else the start of a plain prompt;
- the order of preference among upstreams for a key: weighted rendezvous hashing (each
  upstream scored by a hash of the key and its name; the highest score wins), so a key keeps
  its upstream while others join and leave, and only the keys of an upstream that left move;
- with a bound on load (consistent hashing with bounded loads, Mirrokni et al., 2018): an
  upstream takes a request only while its outstanding requests stay within ``LOAD_BOUND``
  times the average per unit of weight, so one hot prefix spills to the next in preference
  rather than piling up on one replica.
It must not know how a request is sent or how circuits work (``upstream_pool`` asks it only
about upstreams usable now).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

from replystream.engine.base import GenerationRequest
from replystream.engine.upstream_pool import Backend

KEY_CHARS = 2048  # how much of a conversation's start names it
# The paper's c: at most this times the average load per unit of weight. Measured with
# benchmarks/relay/prefix_routing.py (docs/performance.md): 1.25 kept 90% of later turns at
# their history's upstream, 1.5 kept 95%, 2.0 99%, with the load spread 7% apart at 2.0.
LOAD_BOUND = 1.5
_LEADING_ROLES = ("system", "developer")


def affinity_key(request: GenerationRequest) -> str:
    """What keeps ``request`` with the requests that share its prompt's start."""
    if request.prompt_cache_key:
        return f"key:{request.prompt_cache_key}"
    if request.messages:
        kept: list[object] = []
        for message in request.messages:
            kept.append([message.get("role"), message.get("content")])
            if message.get("role") not in _LEADING_ROLES:
                break  # the first user message (or whatever comes first after the leading)
        return "chat:" + json.dumps(kept, ensure_ascii=False)[:KEY_CHARS]
    return "text:" + request.prompt[:KEY_CHARS]


def _score(key: bytes, backend: Backend) -> float:
    """Weighted rendezvous score: -weight / ln(u), u uniform in (0, 1) from the hash."""
    digest = hashlib.blake2b(key + b"\0" + backend.name.encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)
    return -backend.weight / math.log(uniform)


def home(usable: Sequence[Backend], key: str) -> Backend:
    """The upstream of ``usable`` (not empty) ``key`` goes to when load is no matter: the
    first in its order of preference."""
    encoded = key.encode()
    return max(usable, key=lambda b: _score(encoded, b))


def preferred(usable: Sequence[Backend], key: str) -> Backend:
    """The upstream of ``usable`` (not empty) that ``key`` goes to: the first in its order of
    preference whose load stays within the bound."""
    encoded = key.encode()
    ranked = sorted(usable, key=lambda b: _score(encoded, b), reverse=True)
    total = sum(b.outstanding for b in usable) + 1  # this request counted
    per_weight = total / sum(b.weight for b in usable)
    for backend in ranked:
        if backend.outstanding + 1 <= math.ceil(LOAD_BOUND * per_weight * backend.weight):
            return backend
    return min(ranked, key=lambda b: b.outstanding / b.weight)  # (the bound leaves one)
