"""The delivery benchmark's workload: seeds, token schedules and the wire bytes of an event.

Every server in the benchmark streams the same replies: the simulated engine's 120-word reply,
one word per token, each token due at a seeded time from the start of the reply. This module
is shared by the load client and the baseline servers, so the schedule rule and the event bytes
exist once. It must not know about sockets or processes.
"""

from __future__ import annotations

import json

from replystream.engine.simulated import DEFAULT_REPLY, split_words, token_draw

DELAY_MS = 33.0
JITTER_MS = 8.0
WORDS = split_words(DEFAULT_REPLY)
TOKENS = len(WORDS)
BASE_SEED = 1000
TOKEN_MARKER = b"event: token"
DONE_MARKER = b"event: done"


def stream_seeds(count: int, base: int = BASE_SEED) -> list[int]:
    """One seed per stream, so schedules differ between streams but not between servers."""
    return [base + i for i in range(count)]


def gap_ms(
    seed: int, index: int, delay_ms: float = DELAY_MS, jitter_ms: float = JITTER_MS
) -> float:
    """The delay before token ``index`` of the reply seeded ``seed`` (`SimulatedEngine`'s rule)."""
    return delay_ms - jitter_ms + 2.0 * jitter_ms * token_draw(seed, index)


def schedule(seed: int, tokens: int = TOKENS) -> list[float]:
    """Seconds from the start at which each token is due."""
    due: list[float] = []
    elapsed_ms = 0.0
    for index in range(tokens):
        elapsed_ms += gap_ms(seed, index)
        due.append(elapsed_ms / 1000.0)
    return due


def token_frame(index: int) -> bytes:
    """Token ``index`` as replystream's native dialect writes it (ids start after ``reply``)."""
    data = json.dumps({"text": WORDS[index], "tokens": 1})
    return f"event: token\nid: {index + 2}\ndata: {data}\n\n".encode()


def done_frame(tokens: int, finish_reason: str) -> bytes:
    """The end marker after ``tokens`` tokens (replystream also sends ``usage`` before it)."""
    data = json.dumps({"finish_reason": finish_reason})
    return f"event: done\nid: {tokens + 2}\ndata: {data}\n\n".encode()


def request_body(seed: int, max_tokens: int | None = None) -> bytes:
    """The JSON body of ``POST /v1/replies`` for one stream."""
    body: dict[str, object] = {"prompt": "x", "seed": seed}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


def parse_body(raw: bytes) -> tuple[int, int]:
    """``(seed, tokens)`` of a request body; raises ValueError on a bad body."""
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    seed = body.get("seed", 42)
    max_tokens = body.get("max_tokens")
    if not isinstance(seed, int) or (max_tokens is not None and not isinstance(max_tokens, int)):
        raise ValueError("seed and max_tokens must be integers")
    tokens = TOKENS if max_tokens is None else max(1, min(max_tokens, TOKENS))
    return seed, tokens
