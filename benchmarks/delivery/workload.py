"""The delivery benchmark's workload: seeds, token schedules and the wire bytes of an event.

Every server in the benchmark streams the same replies: the simulated engine's 120-word reply,
one word per token, each token due at a seeded time from the start of the reply. This module
is shared by the load client and the baseline servers, so the schedule rule, the request and
the event bytes (an SSE event, or a WebSocket message of ``GET /v1/ws``) exist once. It must
not know about sockets or processes.
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
# A WebSocket message's payload starts with its type (replystream writes compact JSON, "type"
# first); inside a JSON string a quote is escaped, so these bytes start messages and only them.
WS_TOKEN_MARKER = b'{"type":"token"'
WS_DONE_MARKER = b'{"type":"done"'
WS_ERROR_MARKER = b'{"type":"error"'
WS_PATH = "/v1/ws"
WS_TAG = "r1"  # one reply per socket: any tag will do, and a short one is what clients send


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


def request_fields(seed: int, max_tokens: int | None = None) -> dict[str, object]:
    """What one stream asks for, over either transport: the same prompt, seed and length."""
    fields: dict[str, object] = {"prompt": "x", "seed": seed}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return fields


def request_body(seed: int, max_tokens: int | None = None) -> bytes:
    """The JSON body of ``POST /v1/replies`` for one stream."""
    return json.dumps(request_fields(seed, max_tokens)).encode()


def ws_reply_message(tag: str, seed: int, max_tokens: int | None = None) -> bytes:
    """The ``GET /v1/ws`` message that starts the same reply as ``request_body`` does."""
    return json.dumps({"type": "reply", "id": tag, **request_fields(seed, max_tokens)}).encode()


def ws_message(kind: str, tag: str, reply_id: str, seq: int, data: dict[str, object]) -> str:
    """A ``GET /v1/ws`` server message, byte for byte as replystream sends it: the envelope
    compact, the event's data as the reply log holds it (``json.dumps``'s spacing)."""
    envelope = {"type": kind, "id": tag, "reply_id": reply_id, "seq": seq}
    head = json.dumps(envelope, separators=(",", ":"))[:-1]
    return f'{head},"data":{json.dumps(data)}}}'


def ws_token_message(tag: str, reply_id: str, index: int) -> str:
    """Token ``index`` as a WebSocket message (``seq`` numbered as the SSE event's ``id``)."""
    return ws_message("token", tag, reply_id, index + 2, {"text": WORDS[index], "tokens": 1})


def ws_done_message(tag: str, reply_id: str, tokens: int, finish_reason: str) -> str:
    """The WebSocket end marker after ``tokens`` tokens."""
    return ws_message("done", tag, reply_id, tokens + 2, {"finish_reason": finish_reason})


def parse_body(raw: bytes | str) -> tuple[int, int]:
    """``(seed, tokens)`` of a request body; raises ValueError on a bad body."""
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    return parse_fields(body)


def parse_ws_reply(raw: str) -> tuple[str, int, int]:
    """``(tag, seed, tokens)`` of a ``{"type": "reply", ...}`` message; ValueError if bad."""
    message = json.loads(raw)
    if not isinstance(message, dict) or message.get("type") != "reply":
        raise ValueError('the first message must be {"type": "reply", ...}')
    tag = message.get("id")
    if not isinstance(tag, str) or not tag:
        raise ValueError("id must be a non-empty string")
    return (tag, *parse_fields(message))


def parse_fields(body: dict[str, object]) -> tuple[int, int]:
    """``(seed, tokens)`` of a request's fields; raises ValueError on bad ones."""
    seed = body.get("seed", 42)
    max_tokens = body.get("max_tokens")
    if not isinstance(seed, int) or (max_tokens is not None and not isinstance(max_tokens, int)):
        raise ValueError("seed and max_tokens must be integers")
    tokens = TOKENS if max_tokens is None else max(1, min(max_tokens, TOKENS))
    return seed, tokens
