"""The Anthropic Messages dialect: a message's stream events, and the whole message.

This file decides what an Anthropic client (the ``anthropic`` SDK) reads, byte for byte:
- A streamed message is ``event: <type>`` with a ``data:`` object whose ``type`` matches:
  ``message_start`` (the message, empty, with the input tokens), then its content blocks in
  order, each ``content_block_start`` / ``content_block_delta``... / ``content_block_stop``
  with its ``index`` (counted from 0), then ``message_delta`` (the stop reason, and the usage
  so far: input and output tokens, and the input tokens read from the engine's prefix cache
  when it tells them: ``usage_counts``) and ``message_stop``. ``message_start`` waits for the
  reply's first event, so its input tokens are the engine's own count of the prompt as the
  engine fed it (a chat template's tokens included), which a built-in engine gives with its
  first delta, having rendered the prompt once to admit it; the server's estimate only for
  an engine that tells its count at the end (a relay: its upstream's usage comes last),
  which ``message_delta`` then corrects. An error after the first byte is
  ``event: error`` with Anthropic's error object, and the stream then never ends with
  ``message_stop``. Every event keeps our event id (``id:``), so a message can be resumed,
  which Anthropic itself does not offer.
- A text block is opened when text comes (not before: a reply of tool calls only has no text
  block, as Anthropic sends it), and gets one ``content_block_delta`` (``text_delta``) per
  piece of text.
- A tool call is a ``tool_use`` block: the open block is stopped, then ``content_block_start``
  (``{"type": "tool_use", "id", "name", "input": {}}``) at the next index, one
  ``content_block_delta`` (``input_json_delta``, ``partial_json``) per fragment of its
  arguments, ``content_block_stop`` when the next block starts or the message ends, and the
  stop reason ``tool_use``. Text after a call opens a new text block at the next index.
  Blocks never interleave: calls whose fragments an upstream interleaved (chat's indexes
  allow it) go one block after another, what came while a call's arguments were incomplete
  waiting until they are (``sequential_calls``).
- A reasoning model's thinking, relayed when the request enabled ``thinking``, is a
  ``thinking`` block before the text (``{"type": "thinking", "thinking": "", "signature":
  ""}``), one ``thinking_delta`` per piece; asked with ``display: "omitted"``, the block
  alone, no ``thinking_delta``, its ``thinking`` empty in the whole message too. Its
  ``signature`` stays empty and no ``signature_delta`` is sent: the signature is Anthropic's
  seal on its own models' thinking, which no relay can make, so such a block cannot be sent
  back to Anthropic's own API.
- The same message whole, not streamed, is the ``message`` object with the same blocks in
  the same order (a ``tool_use`` block's ``input`` parsed from the arguments).
Stop reasons: ``end_turn`` (the model's own end), ``max_tokens``, ``stop_sequence`` (one of
``stop_sequences`` completed; ``stop_sequence`` names it), ``tool_use``, ``refusal`` (a check
stopped the text, ours or a relayed upstream's filter; or the model declined to answer, a
relayed upstream's refusal: ``Delta.refusal``, whose words are the message's text, as
Anthropic's own API has no field for them). A format object serves one message.
It must not know about sockets, tasks or stores.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from replystream.delivery.error_types import anthropic_error_type
from replystream.delivery.formats import (
    REQUEST_FAULT_CODES,
    Spec,
    Usage,
    json_string,
    moderated_payload,
)
from replystream.delivery.moderation import Violation
from replystream.delivery.replay import LogEntry
from replystream.delivery.reply_content import Thought, in_order
from replystream.delivery.sequential_calls import (
    Piece,
    SequentialCalls,
    TextPiece,
    ThinkingPiece,
)
from replystream.delivery.tool_calls import ToolCall
from replystream.engine.base import TokenLogprob, ToolCallDelta

PING = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's keep-alive
DIALECT = "anthropic"  # a Messages reply's ``ReplyInfo.dialect``
# An upstream's own filter (``content_filter``) stopped the text as a check of ours would.
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def stop_reason_of(finish_reason: str, stop_sequence: str | None, refused: bool) -> str:
    """The stop reason of a message that finished: ``stop_sequence`` when one ended it, else
    its finish reason's (``refusal`` for a refusal the model finished)."""
    if stop_sequence is not None:
        return "stop_sequence"
    if refused and finish_reason == "stop":
        return "refusal"
    return STOP_REASONS.get(finish_reason, "end_turn")


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
    usage: Usage,
    stop_sequence: str | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
    thoughts: tuple[Thought, ...] = (),
    thinking_text: bool = True,
) -> dict[str, Any]:
    """The ``message`` object (whole, or empty as ``message_start`` carries it: ``text``
    None); its content the thinking, text and calls in the order they came (a thinking
    block's text left out unless ``thinking_text``)."""
    content: list[dict[str, Any]] = []
    for piece in () if text is None else in_order(text, tool_calls, thoughts):
        if isinstance(piece, str):
            content.append({"type": "text", "text": piece})
        elif isinstance(piece, Thought):
            thought = piece.text if thinking_text else ""
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        else:
            content.append(
                {
                    "type": "tool_use",
                    "id": piece.id,
                    "name": piece.name,
                    "input": piece.parsed_arguments(),
                }
            )
    return {
        "id": message_id(reply_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_counts(usage),
    }


def usage_counts(usage: Usage) -> dict[str, int]:
    """Anthropic's usage for ours. Its ``input_tokens`` are the prompt's tokens not read
    from a cache, and ``cache_read_input_tokens`` those read (the prompt is their sum, with
    the ``cache_creation_input_tokens`` no engine here tells), so a prompt whose engine said
    how many it found in its prefix cache is split so; else ``input_tokens`` is all of it and
    no cache count is named, as Anthropic's own API answers a request that used no cache."""
    cached = usage.cached_prompt_tokens
    if cached is None:
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.completion_tokens,
    }


# Our codes of endings no HTTP status tells (the server's own, a reader's) after which the
# server cannot go on now, which Anthropic's API says as its ``overloaded_error`` (its 529),
# as their 503 before a stream is: shutting down, the reply store out of reach. An engine's
# failure carries its status, whose type it takes (``error_types``).
OVERLOADED_CODES = frozenset({"shutdown", "replay_store_unavailable"})


def error_object(
    message: str, code: str, param: str | None = None, status: int | None = None
) -> dict[str, Any]:
    """Anthropic's error object (``type``, ``message``), with our code beside them. With
    ``param`` (the request's parameter at fault, named beside them too), or a code of the
    request's fault (``REQUEST_FAULT_CODES``), an ``invalid_request_error``; given the
    ``status`` the failure is before a stream, the type of that status, as the whole
    message's error has it (a relay's upstream that rate-limited a continued reply's key is
    a ``rate_limit_error``, as its 429 is); else, by our code, an ``overloaded_error`` when
    the server cannot go on now, else its ``api_error``."""
    if param is not None or code in REQUEST_FAULT_CODES:
        error = {"type": "invalid_request_error", "message": message, "code": code}
        return {"type": "error", "error": error if param is None else error | {"param": param}}
    if status is not None:
        kind = anthropic_error_type(status)
    elif code in OVERLOADED_CODES:
        kind = "overloaded_error"
    else:
        kind = "api_error"
    return {"type": "error", "error": {"type": kind, "message": message, "code": code}}


class ReaderNotices:
    """How a message stream spells what its reader decides (a slow client, a lost producer,
    a store that cannot be reached, events lost): an ``error`` event with Anthropic's error
    object, as the producer's own errors are, so a client reads one shape whoever ended the
    stream."""

    __slots__ = ()
    tells_gaps = False  # an ``events_lost`` error ends the stream instead

    def sent(self, entries: Sequence[LogEntry]) -> None:
        pass  # what was sent changes nothing in an Anthropic error

    def __call__(self, event: str, data: str, after: int) -> list[tuple[str, str]]:
        if event != "error":
            return [(event, data)]
        error = json.loads(data)["error"]
        message, code, param = error["message"], error["code"], error.get("param")
        return [("error", _dumps(error_object(message, code, param)))]


@dataclass(slots=True)
class AnthropicStreamFormat:
    """The events of one streamed message (a ``StreamFormat``)."""

    model: str
    # The prompt's tokens, found only if a message must start before the engine's first delta
    # has counted them (an error came first): the engine's count found apart, or an estimate.
    count_input: Callable[[], int]
    # ``thinking.display: "omitted"``: a thinking block is sent without its text.
    thinking_text: bool = True
    input_tokens: int | None = None  # the engine's count, once its first delta gave it
    _cached_input_tokens: int | None = None  # of those, its prefix cache's, if it tells
    _reply_id: str | None = None  # until ``message_start`` is sent
    _open: int | None = None  # the index of the block open now (None: none)
    _text_open: bool = False  # that block is a text block
    _thinking_open: bool = False  # that block is a thinking block
    _next_block: int = 0  # the index the next block gets
    _blocks: dict[int, int] = field(default_factory=dict)  # tool call index -> block index
    _delta_head: str = ""  # a text delta's JSON up to its text, for the open text block
    _calls: SequentialCalls | None = None  # one call at a time (None: no call yet)
    _refused: bool = False  # the text is the model's refusal (``refusing``)

    def started(self, reply_id: str) -> list[Spec]:
        # Sent with the first event, when the engine has counted the prompt (its first
        # delta says so): Anthropic's message_start carries the real count.
        self._reply_id = reply_id
        return []

    def admitted(self) -> list[Spec]:
        return []  # no such event: a message says nothing of a queue

    def prompt_counted(self, tokens: int, cached: int | None) -> None:
        self.input_tokens, self._cached_input_tokens = tokens, cached

    def _message_start(self) -> list[Spec]:
        """``message_start``, if it is not sent yet: before any other event."""
        reply_id = self._reply_id
        if reply_id is None:
            return []
        self._reply_id = None
        if self.input_tokens is None:
            self.input_tokens = self.count_input()
        empty = message_object(
            reply_id,
            self.model,
            text=None,
            stop_reason=None,
            usage=Usage(self.input_tokens, 0, cached_prompt_tokens=self._cached_input_tokens),
        )
        return [("message_start", _dumps({"type": "message_start", "message": empty}))]

    def text(self, text: str, tokens: int) -> list[Spec]:
        # Spelt out: one per piece of text, the event every message sends most.
        if self._text_open:
            return [("content_block_delta", self._delta_head + json_string(text) + "}}")]
        if not text:
            return []  # no block is opened for no text
        calls = self._calls
        if calls is not None and calls.calling:  # after a call's arguments, perhaps incomplete
            return calls.take(TextPiece(text, tokens), self._place)
        specs = self._message_start() + self._start_block({"type": "text", "text": ""})
        self._text_open = True
        self._delta_head = (
            f'{{"type":"content_block_delta","index":{self._open},'
            '"delta":{"type":"text_delta","text":'
        )
        specs.append(("content_block_delta", self._delta_head + json_string(text) + "}}"))
        return specs

    def text_logprobs(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> list[Spec]:
        return self.text(text, tokens)  # never asked: /v1/messages takes no logprobs

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        if self._calls is None:  # made at the first call: a reply of text never needs it
            self._calls = SequentialCalls()
        return self._calls.take(piece, self._place)

    def _place(self, piece: Piece) -> list[Spec]:
        """The events of a piece ``SequentialCalls`` lets go now."""
        if isinstance(piece, ToolCallDelta):
            return self._tool_call(piece)
        if isinstance(piece, ThinkingPiece):
            return self._reasoning(piece.text)
        return self.text(piece.text, piece.tokens)  # (no call open now: it goes through)

    def _tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        specs = self._message_start()
        block = self._blocks.get(piece.index)
        if block is None:  # a new call: stop the open block, start a tool_use block
            specs += self._start_block(
                {"type": "tool_use", "id": piece.id or "", "name": piece.name or "", "input": {}}
            )
            block = self._blocks[piece.index] = self._next_block - 1
        if piece.arguments:
            delta = {
                "type": "content_block_delta",
                "index": block,
                "delta": {"type": "input_json_delta", "partial_json": piece.arguments},
            }
            specs.append(("content_block_delta", _dumps(delta)))
        return specs

    def reasoning(self, thought: str, tokens: int) -> list[Spec]:
        calls = self._calls
        if calls is not None and calls.calling:  # after a call's arguments, perhaps incomplete
            return calls.take(ThinkingPiece(thought, tokens), self._place)
        return self._reasoning(thought)

    def _reasoning(self, thought: str) -> list[Spec]:
        specs = self._message_start()
        if not self._thinking_open:
            specs += self._start_block({"type": "thinking", "thinking": "", "signature": ""})
            self._thinking_open = True
        if not self.thinking_text:
            return specs  # the block says the model thought here; its words are not sent
        delta = {
            "type": "content_block_delta",
            "index": self._open,
            "delta": {"type": "thinking_delta", "thinking": thought},
        }
        specs.append(("content_block_delta", _dumps(delta)))
        return specs

    def _start_block(self, content_block: dict[str, Any]) -> list[Spec]:
        """Stop the open block, if any, and start the next one."""
        specs = self._stop_block()
        index = self._open = self._next_block
        self._next_block += 1
        start = {"type": "content_block_start", "index": index, "content_block": content_block}
        specs.append(("content_block_start", _dumps(start)))
        return specs

    def _stop_block(self) -> list[Spec]:
        if self._open is None:
            return []
        stop = {"type": "content_block_stop", "index": self._open}
        self._open, self._text_open, self._thinking_open = None, False, False
        return [("content_block_stop", _dumps(stop))]

    def _held(self) -> list[Spec]:
        """The events of every piece still held for a call's arguments: the message ends."""
        return [] if self._calls is None else self._calls.flush(self._place)

    def _ending(self, stop_reason: str, usage: Usage, **extra: Any) -> list[Spec]:
        # Cumulative, as Anthropic's are: the SDK's final message takes these, so the engine's
        # own prompt count replaces the estimate message_start had to send when the engine
        # tells it only at the end (a relay's upstream reports it last).
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None, **extra},
            "usage": usage_counts(usage),
        }
        specs = self._message_start() + self._held()
        return [
            *specs,
            *self._stop_block(),
            ("message_delta", _dumps(delta)),
            ("message_stop", '{"type":"message_stop"}'),
        ]

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        stop_reason = stop_reason_of(finish_reason, stop_sequence, self._refused)
        if stop_sequence is not None:
            return self._ending(stop_reason, usage, stop_sequence=stop_sequence)
        return self._ending(stop_reason, usage)

    def error(self, message: str, code: str, status: int | None = None) -> list[Spec]:
        specs = self._message_start() + self._held()
        return [*specs, ("error", _dumps(error_object(message, code, status=status)))]

    def continued(self, reason: str, tokens: int) -> list[Spec]:
        return []  # no such event in this dialect: the text simply goes on

    def refusing(self) -> list[Spec]:
        self._refused = True  # said by the stop reason; the words are a text block's
        return []

    def moderated(self, violation: Violation, usage: Usage) -> list[Spec]:
        return self._ending("refusal", usage, replystream_moderation=moderated_payload(violation))
