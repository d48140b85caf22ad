"""The Anthropic Messages dialect: a message's stream events, and the whole message.

This file decides what an Anthropic client (the ``anthropic`` SDK) reads, byte for byte:
- A streamed message is ``event: <type>`` with a ``data:`` object whose ``type`` matches:
  ``message_start`` (the message, empty, with the input tokens), ``content_block_start`` of
  block 0 (text), one ``content_block_delta`` (``text_delta``) per piece of text,
  ``content_block_stop``, ``message_delta`` (the stop reason and the output tokens), then
  ``message_stop``. An error after the first byte is ``event: error`` with Anthropic's error
  object, and the stream then never ends with ``message_stop``. Every event keeps our event
  id (``id:``), so a message can be resumed, which Anthropic itself does not offer.
- A tool call is a ``tool_use`` block after the text block: the text block is stopped, then
  ``content_block_start`` (``{"type": "tool_use", "id", "name", "input": {}}``) at the next
  index, one ``content_block_delta`` (``input_json_delta``, ``partial_json``) per fragment of
  its arguments, ``content_block_stop`` when the next call starts or the message ends, and
  the stop reason ``tool_use``. Block 0 is always the text block, opened with the message
  before the first delta is known: empty when the reply opens with a tool call (the whole
  message lists it too, so the streamed and the whole message are the same); text that comes
  after a call joins it (the SDK adds deltas to the block their index names).
- The same message whole, not streamed, is the ``message`` object (a ``tool_use`` block's
  ``input`` parsed from the arguments).
Stop reasons: ``end_turn`` (the model's own end), ``max_tokens``, ``stop_sequence`` (one of
``stop_sequences`` completed; ``stop_sequence`` names it), ``tool_use``, ``refusal`` (a check
stopped the text). A format object serves one message. It must not know about sockets,
tasks or stores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from replystream.delivery.formats import Spec, Usage, json_string, moderated_payload
from replystream.delivery.moderation import Violation
from replystream.delivery.tool_calls import ToolCall
from replystream.engine.base import TokenLogprob, ToolCallDelta

PING = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's keep-alive
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def message_id(reply_id: str) -> str:
    return "msg_" + reply_id


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"))


def message_object(
    reply_id: str,
    model: str,
    *,
    text: str | None,
    stop_reason: str | None,
    input_tokens: int,
    output_tokens: int,
    stop_sequence: str | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
) -> dict[str, Any]:
    """The ``message`` object (whole, or empty as ``message_start`` carries it)."""
    content: list[dict[str, Any]] = [] if text is None else [{"type": "text", "text": text}]
    content += (
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.parsed_arguments()}
        for call in tool_calls
    )
    return {
        "id": message_id(reply_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def error_object(message: str, code: str, kind: str = "api_error") -> dict[str, Any]:
    """Anthropic's error object (``type``, ``message``), with our code beside them."""
    return {"type": "error", "error": {"type": kind, "message": message, "code": code}}


@dataclass(slots=True)
class AnthropicStreamFormat:
    """The events of one streamed message (a ``StreamFormat``)."""

    model: str
    input_tokens: int
    _tokens: int = 0
    _text: list[str] = field(default_factory=list)
    _open: int = 0  # the index of the block open now (0: the text block)
    _blocks: dict[int, int] = field(default_factory=dict)  # tool call index -> block index

    def started(self, reply_id: str) -> list[Spec]:
        empty = message_object(
            reply_id,
            self.model,
            text=None,
            stop_reason=None,
            input_tokens=self.input_tokens,
            output_tokens=0,
        )
        block = {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "text", "text": ""},
        }
        return [
            ("message_start", _dumps({"type": "message_start", "message": empty})),
            ("content_block_start", _dumps(block)),
        ]

    def text(self, text: str, tokens: int) -> Spec:
        self._tokens += tokens
        # Spelt out: one per piece of text, the event every message sends most.
        return (
            "content_block_delta",
            '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
            + json_string(text)
            + "}}",
        )

    def text_logprobs(self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]) -> Spec:
        return self.text(text, tokens)  # never asked: /v1/messages takes no logprobs

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        specs: list[Spec] = []
        block = self._blocks.get(piece.index)
        if block is None:  # a new call: stop the open block, start a tool_use block
            block = self._blocks[piece.index] = len(self._blocks) + 1
            specs.append(self._stop_block())
            self._open = block
            start = {
                "type": "content_block_start",
                "index": block,
                "content_block": {
                    "type": "tool_use",
                    "id": piece.id or "",
                    "name": piece.name or "",
                    "input": {},
                },
            }
            specs.append(("content_block_start", _dumps(start)))
        if piece.arguments:
            delta = {
                "type": "content_block_delta",
                "index": block,
                "delta": {"type": "input_json_delta", "partial_json": piece.arguments},
            }
            specs.append(("content_block_delta", _dumps(delta)))
        return specs

    def _stop_block(self) -> Spec:
        return "content_block_stop", _dumps({"type": "content_block_stop", "index": self._open})

    def _ending(self, stop_reason: str, usage: Usage | None, **extra: Any) -> list[Spec]:
        tokens = self._tokens if usage is None else usage.completion_tokens
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None, **extra},
            "usage": {"output_tokens": tokens},
        }
        return [
            self._stop_block(),
            ("message_delta", _dumps(delta)),
            ("message_stop", '{"type":"message_stop"}'),
        ]

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        if stop_sequence is not None:
            return self._ending("stop_sequence", usage, stop_sequence=stop_sequence)
        return self._ending(STOP_REASONS.get(finish_reason, "end_turn"), usage)

    def error(self, message: str, code: str) -> list[Spec]:
        return [("error", _dumps(error_object(message, code)))]

    def moderated(self, violation: Violation) -> list[Spec]:
        return self._ending("refusal", None, replystream_moderation=moderated_payload(violation))
