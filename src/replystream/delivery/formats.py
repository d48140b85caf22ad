"""How a reply's pieces are framed as server-sent events, one class per wire dialect.

The lab dialect is the reference article's: ``data: "<JSON string>"`` per event and
``data: [DONE]`` at the end. The native dialect names every event (``token``, ``usage``,
``moderated``, ``error``, ``done``), so a client can tell an error from a finish without
parsing JSON. Both end a failed reply with ``event: error`` and never with their end marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from replystream.delivery.moderation import Violation
from replystream.sse import encode_comment, encode_data

KEEPALIVE = encode_comment("keep-alive")


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class StreamFormat(Protocol):
    """Frames for one dialect; each method returns whole events as bytes."""

    def text(self, text: str, tokens: int) -> bytes: ...

    def finished(self, finish_reason: str, usage: Usage) -> bytes: ...

    def error(self, message: str, code: str) -> bytes: ...

    def moderated(self, violation: Violation) -> bytes: ...


def error_frame(message: str, code: str) -> bytes:
    return encode_data(json.dumps({"error": {"message": message, "code": code}}), type="error")


def moderated_payload(violation: Violation) -> dict[str, object]:
    return {
        "check": violation.check,
        "reason": violation.reason,
        "released_chars": violation.released_chars,
        "released_tokens": violation.released_tokens,
    }


class LabFormat:
    """``data: "text"`` per event, ``data: [DONE]`` at the end (the article's format)."""

    def text(self, text: str, tokens: int) -> bytes:
        return encode_data(json.dumps(text))

    def finished(self, finish_reason: str, usage: Usage) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, message: str, code: str) -> bytes:
        return error_frame(message, code)

    def moderated(self, violation: Violation) -> bytes:
        return encode_data(json.dumps(moderated_payload(violation)), type="moderated")


class NativeFormat:
    """Named events: ``token``, ``usage``, ``moderated``, ``error``, ``done``."""

    def text(self, text: str, tokens: int) -> bytes:
        return encode_data(json.dumps({"text": text, "tokens": tokens}), type="token")

    def finished(self, finish_reason: str, usage: Usage) -> bytes:
        return encode_data(json.dumps(usage.as_dict()), type="usage") + encode_data(
            json.dumps({"finish_reason": finish_reason}), type="done"
        )

    def error(self, message: str, code: str) -> bytes:
        return error_frame(message, code)

    def moderated(self, violation: Violation) -> bytes:
        return encode_data(json.dumps(moderated_payload(violation)), type="moderated")
