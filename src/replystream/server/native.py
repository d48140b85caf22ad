"""The native reply endpoint's request body: parse and validate, naming the bad field.

``POST /v1/replies`` takes::

    {"prompt": "..."}  or  {"messages": [{"role": "user", "content": "..."}, ...]}
    sampling:  max_tokens, temperature, top_p, top_k, seed, stop (a string or a list)
    delivery:  stream (default true), batch_tokens, batch_ms, holdback_tokens, keepalive_s
    resume:    resumable (true/false), disconnect ("cancel" or "detach")

Every mistake is an ``HTTPAPIError`` (400 with the field in ``param``), never a 500.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.server.errors import HTTPAPIError
from replystream.server.guard import read_body
from replystream.server.replies import Disconnect

ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
KNOWN_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "batch_tokens",
        "batch_ms",
        "holdback_tokens",
        "keepalive_s",
        "resumable",
        "disconnect",
    }
)


@dataclass(frozen=True, slots=True)
class ReplyRequest:
    generation: GenerationRequest
    stream: bool
    policy: DeliveryPolicy
    resumable: bool | None = None  # None: the server's default
    disconnect: Disconnect | None = None  # None: detach if resumable, else cancel


def _bad(param: str, message: str) -> HTTPAPIError:
    return HTTPAPIError(400, message, code="invalid_value", param=param)


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it."""
    raw = await read_body(request)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPAPIError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPAPIError(400, "body must be a JSON object", code="invalid_json")
    return body


def number_field(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    """``body[name]`` as a finite number within [low, high], None if absent; else a 400."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"{name} must be a number")
    if not low <= value <= high:
        raise _bad(name, f"{name} must be between {low:g} and {high:g}, got {value}")
    return float(value)


def integer_field(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """``body[name]`` as an integer within [low, high], None if absent; else a 400."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"{name} must be an integer")
    if not low <= value <= high:
        raise _bad(name, f"{name} must be between {low} and {high}, got {value}")
    return value


def prompt_from_messages(messages: Any) -> str:
    """A plain-text prompt from chat messages (one ``role: content`` line each)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list")
    lines = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(where, f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and part.get("type") == "text"
            )
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"{where}.content must be a string")
        lines.append(f"{role}: {content}")
    return "\n".join(lines)


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or len(value) > 4
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise _bad("stop", "stop must be a non-empty string or a list of up to 4 of them")
    return tuple(value)


def parse_reply_request(
    body: dict[str, Any], defaults: DeliveryPolicy, max_prompt_chars: int
) -> ReplyRequest:
    """Validate a native reply request against the server's defaults and limits."""
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _bad(unknown[0], f"unknown field {unknown[0]!r}")
    if ("prompt" in body) == ("messages" in body):
        raise _bad("prompt", "give exactly one of prompt or messages")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise _bad("prompt", "prompt must be a string")
        param = "prompt"
    else:
        prompt = prompt_from_messages(body["messages"])
        param = "messages"
    if len(prompt) > max_prompt_chars:
        raise HTTPAPIError(
            400,
            f"prompt is {len(prompt)} characters; the limit is {max_prompt_chars}",
            code="prompt_too_long",
            param=param,
        )
    temperature = number_field(body, "temperature", 0.0, 2.0)
    top_p = number_field(body, "top_p", 0.0, 1.0)
    sampling = SamplingParams(
        max_tokens=integer_field(body, "max_tokens", 1, 1 << 20),
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=integer_field(body, "top_k", 0, 1 << 20) or 0,
        seed=integer_field(body, "seed", 0, 2**63 - 1),
        stop=parse_stop(body.get("stop")),
    )
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise _bad("stream", "stream must be true or false")
    resumable = body.get("resumable")
    if resumable is not None and not isinstance(resumable, bool):
        raise _bad("resumable", "resumable must be true or false")
    if resumable and not stream:
        raise _bad("resumable", "a resumable reply must be streamed (stream: true)")
    disconnect = body.get("disconnect")
    if disconnect not in (None, "cancel", "detach"):
        raise _bad("disconnect", 'disconnect must be "cancel" or "detach"')
    policy = delivery_overrides(body, defaults)
    messages = tuple(body["messages"]) if "messages" in body else None
    generation = GenerationRequest(prompt, sampling, messages)
    return ReplyRequest(generation, stream, policy, resumable, disconnect)


def delivery_overrides(body: dict[str, Any], defaults: DeliveryPolicy) -> DeliveryPolicy:
    """The server's delivery policy with this request's overrides applied."""
    changes: dict[str, object] = {}
    batch_tokens = integer_field(body, "batch_tokens", 1, 4096)
    if batch_tokens is not None:
        changes["batch_tokens"] = batch_tokens
    if body.get("batch_ms") is not None:
        changes["batch_ms"] = number_field(body, "batch_ms", 0.0, 60_000.0)
    holdback = integer_field(body, "holdback_tokens", 0, 4096)
    if holdback is not None:
        changes["holdback_tokens"] = holdback
    if body.get("keepalive_s") is not None:
        changes["keepalive_s"] = number_field(body, "keepalive_s", 0.1, 3600.0)
    return defaults.with_overrides(**changes) if changes else defaults
