"""The OpenAI wire dialect: chat and legacy completion chunks, and their whole-reply bodies.

This file decides what an OpenAI-compatible client reads, byte for byte:
- A streamed chat reply is ``data: {chat.completion.chunk}`` messages: a first chunk with
  ``delta.role = "assistant"`` (it carries the reply id, as resume needs), one chunk per
  batch of text, a chunk with ``finish_reason`` and an empty delta, a usage chunk
  (``choices: []``) when the client asked for one, then ``data: [DONE]``.
- A tool call streams as OpenAI's ``delta.tool_calls``: one chunk per piece, ``index`` on
  every one; ``id``, ``type: "function"`` and ``function.name`` on the piece that names the
  call (its first; ``arguments`` then as it came, ``""`` from our engines), then
  ``function.arguments`` fragments; the reply ends with ``finish_reason: "tool_calls"``.
  Whole, the message has ``tool_calls`` and ``content: null`` when it has no text.
- A refusal (a relayed upstream's model declined to answer, most often a reply held to a JSON
  form: ``Delta.refusal``) streams as OpenAI's own do, its text in ``delta.refusal`` instead of
  ``delta.content``, finishing ``stop``; whole, the message has ``content: null`` and the
  words in ``refusal``. A legacy completion has no such field: its words are its text.
- A reasoning model's thinking, relayed, streams as ``delta.reasoning_content`` (DeepSeek's
  spelling, which the SDKs keep as an extra field and most gateways and clients read), one
  chunk per piece; the usage then names its tokens (``completion_tokens_details``). Whole, the
  message has ``reasoning_content`` beside its ``content``.
- A legacy ``text_completion`` stream is the same with ``choices[0].text`` and no role chunk
  (its first chunk has empty text), and no thinking and no tool calls (a reply that ended
  with calls finishes ``stop``, one of the three finish reasons that object has).
- An error after the first byte is ``event: error`` with ``data: {"error": {"message",
  "type", "param", "code"}}`` (the reader's own endings too: ``ReaderNotices``): the OpenAI
  SDKs raise ``APIError`` on an ``error`` key in any message, clients that read only
  ``data:`` lines see the same object, and replystream's own clients see the event type.
  The stream then never ends with ``[DONE]``.
- A moderated reply ends like OpenAI's own filtered replies: a chunk with
  ``finish_reason: "content_filter"`` (plus a ``replystream_moderation`` object naming the
  check; OpenAI's own ``moderation`` field has another shape), then the usage chunk (when
  asked for: the tokens made, held ones included) and ``[DONE]``. The finish reason, not a
  missing end marker, tells the client it was cut.
- Log probabilities, when asked, are in each text chunk's choice in OpenAI's shapes: chat
  ``logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}], "refusal": null}``; legacy ``logprobs: {tokens, token_logprobs, top_logprobs:
  [{token: logprob}], text_offset}``; exactly the tokens of that chunk's text. A legacy
  ``text_offset`` is a place in the prompt and the completion together, as OpenAI's are:
  the first token's is the prompt's length in characters (``text_offset_from``).
- A reply with several choices (``n > 1``) has one format per choice (``index``,
  ``one_of_many``): each sends its own role chunk, text chunks and finish chunk with its
  ``index``; the usage chunk (summed) and ``[DONE]`` come once, after every choice finished
  (``reply_end``).
A format object serves one reply: it remembers the reply id ``started`` was given, because
every chunk repeats it. It must not know about sockets, tasks or stores.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from replystream.delivery.error_types import openai_error_type
from replystream.delivery.formats import (
    REQUEST_FAULT_CODES,
    Spec,
    Usage,
    json_compact,
    json_string,
    moderated_payload,
)
from replystream.delivery.moderation import Violation
from replystream.delivery.replay import LogEntry
from replystream.delivery.sliced_json import Sliced
from replystream.delivery.tool_calls import ToolCall
from replystream.engine.base import TokenLogprob, ToolCallDelta, TopLogprob, escaped_bytes

Kind = Literal["chat", "text"]
DONE: Spec = (None, "[DONE]")
DIALECT = "openai"  # a chat or completion reply's ``ReplyInfo.dialect``
MODERATED_FINISH = "content_filter"
MODERATION_FIELD = "replystream_moderation"
_ID_PREFIX = {"chat": "chatcmpl-", "text": "cmpl-"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "text": "text_completion"}
_BODY_OBJECT = {"chat": "chat.completion", "text": "text_completion"}
# Stands for a text chunk's text while its template is made (the last one in the chunk:
# the choices come after the id and the model, whatever they hold).
_TEXT_PLACEHOLDER = "\x00text\x00"
_TEXT_PLACEHOLDER_JSON = json_string(_TEXT_PLACEHOLDER)


def _dumps(payload: dict[str, Any]) -> str:
    """A payload with floats (log probabilities), as json.dumps writes them; every other
    payload is ``json_compact``'s, the same bytes at a fraction of the cost."""
    return json.dumps(payload, separators=(",", ":"))


def _finish_reason(kind: Kind, finish_reason: str) -> str:
    """The finish reason as this kind says it: a legacy completion shows no tool calls, so
    a reply that ended with calls ended as the model's own end (``stop``) there."""
    if kind == "text" and finish_reason == "tool_calls":
        return "stop"
    return finish_reason


def completion_id(kind: Kind, reply_id: str) -> str:
    """The OpenAI-style id of a reply: ``chatcmpl-<reply id>`` or ``cmpl-<reply id>``."""
    return _ID_PREFIX[kind] + reply_id


def _candidate(token: TopLogprob | TokenLogprob, with_bytes: bool) -> dict[str, Any]:
    if with_bytes:
        return {"token": token.token, "logprob": token.logprob, "bytes": list(token.bytes)}
    return {"token": token.token, "logprob": token.logprob}


def logprob_entries(
    made: Sequence[TokenLogprob], *, with_bytes: bool = True
) -> list[dict[str, Any]]:
    """One ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`` entry per
    token, as chat's ``logprobs.content`` and a Responses ``output_text`` part list them.
    ``with_bytes=False``: without ``bytes``, as OpenAI's spec has a Responses text event's
    (``response.output_text.delta`` and ``.done``) entries."""
    return [
        {
            **_candidate(token, with_bytes),
            "top_logprobs": [_candidate(t, with_bytes) for t in token.top],
        }
        for token in made
    ]


def chat_logprobs(
    made: tuple[TokenLogprob, ...], *, sliced: bool = False, refusal: bool = False
) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object for these tokens (``sliced``: its entries made as
    ``dumps_sliced`` writes them, for a whole reply's body; ``refusal``: they are a
    refusal's, listed under its name, as OpenAI lists them)."""
    entries = Sliced(made, logprob_entries) if sliced else logprob_entries(made)
    return (
        {"content": None, "refusal": entries} if refusal else {"content": entries, "refusal": None}
    )


_utf8_decoder = codecs.getincrementaldecoder("utf-8")


def legacy_token(token: TopLogprob | TokenLogprob) -> str:
    """A token as legacy ``logprobs`` name it: its name; or, when its bytes are not whole
    UTF-8 characters, ``bytes:`` and its bytes escaped (``bytes:\\xe2\\x80``,
    ``bytes: \\xe6\\x9e``), as OpenAI's legacy completions do, whatever an upstream called
    it (a relayed one may read U+FFFD, the same for every such token: as ``top_logprobs``
    keys, they would be one)."""
    try:
        token.bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + escaped_bytes(token.bytes)
    return token.token


class TextOffsets:
    """Where each token of one legacy completion begins (``text_offset``): the characters
    before the completion (``start``: its prompt's, as OpenAI counts from the prompt's start
    whether or not it is echoed) and those of the tokens before it, decoded from their bytes
    as one stream. Counted from the tokens, not from the text of the chunks that carry them:
    a chunk may carry a
    token whose text is only partly out (the rest held back, as a stop string's possible
    start, and sent with a later token). The tokens of one character (a byte each, read as
    U+FFFD apiece) make one character, and a token that ends one begins where it begins."""

    __slots__ = ("_chars", "_decoder")

    def __init__(self, start: int = 0) -> None:
        self._decoder = _utf8_decoder(errors="replace")
        self._chars = start

    def place(self, token: TokenLogprob) -> int:
        """Where ``token``, the one after those placed so far, begins."""
        at = self._chars
        if token.in_text:  # a control token is named but adds no text
            self._chars += len(self._decoder.decode(token.bytes))
        return at


def completion_logprobs(
    made: tuple[TokenLogprob, ...], offsets: TextOffsets, *, sliced: bool = False
) -> dict[str, Any]:
    """A legacy choice's ``logprobs`` object for these tokens, the next ones of the completion
    ``offsets`` places. ``top_logprobs`` holds the likeliest tokens and the made one (OpenAI:
    "up to logprobs+1 elements"), each named by ``legacy_token``, as ``tokens`` are
    (``sliced``: made as ``dumps_sliced`` writes them, for a whole reply's body)."""
    return {
        "tokens": [legacy_token(token) for token in made],
        "token_logprobs": [token.logprob for token in made],
        "top_logprobs": Sliced(made, _legacy_tops) if sliced else _legacy_tops(made),
        "text_offset": [offsets.place(token) for token in made],
    }


def _legacy_tops(made: Sequence[TokenLogprob]) -> list[dict[str, float]]:
    tops: list[dict[str, float]] = []
    for token in made:
        # Tokens of one name (two of a relayed upstream's that it names alike) are one key:
        # it keeps the likeliest's log probability, as the alternatives come best first.
        top: dict[str, float] = {}
        for t in token.top:
            top.setdefault(legacy_token(t), t.logprob)
        top.setdefault(legacy_token(token), token.logprob)
        tops.append(top)
    return tops


def in_band_error(
    message: str, code: str, param: str | None = None, status: int | None = None
) -> Spec:
    """An error after the stream started, in the shape the OpenAI SDKs raise ``APIError`` on;
    ``param``: the request's parameter at fault (the reply itself did not fail). That, or a
    code of the request's fault (``REQUEST_FAULT_CODES``), is an ``invalid_request_error``;
    else, given the ``status`` the failure is before a stream, the type of that status (a
    relay's upstream refusing a continued reply's key, or rate-limiting it, is the
    ``invalid_request_error`` or ``requests`` its whole reply's 401 or 429 is), else a
    ``server_error``."""
    if param is not None or code in REQUEST_FAULT_CODES:
        kind = "invalid_request_error"
    else:
        kind = "server_error" if status is None else openai_error_type(status)
    error = {"message": message, "type": kind, "param": param, "code": code}
    return "error", json_compact({"error": error})


class ReaderNotices:
    """How a chat or completion stream spells what its reader decides (a slow client, a
    lost producer, a store that cannot be reached, events lost): the error object the producer's own
    errors have (``in_band_error``), so the SDK's ``APIError`` has its ``type`` and
    ``param`` whoever ended the stream."""

    __slots__ = ()
    tells_gaps = False  # an ``events_lost`` error ends the stream instead

    def sent(self, entries: Sequence[LogEntry]) -> None:
        pass  # what was sent changes nothing in the error

    def __call__(self, event: str, data: str, after: int) -> list[tuple[str, str]]:
        if event != "error":
            return [(event, data)]
        error = json.loads(data)["error"]
        kind, spelt = in_band_error(error["message"], error["code"], error.get("param"))
        return [(kind or "error", spelt)]


@dataclass(slots=True)
class OpenAIStreamFormat:
    """Chunks of one streamed chat (``kind="chat"``) or legacy completion (``"text"``) reply."""

    kind: Kind
    model: str
    created: int
    include_usage: bool = False
    index: int = 0  # the choice this format's chunks carry
    one_of_many: bool = False  # the reply's ending is sent once, for all its choices
    text_offset_from: int = 0  # a legacy completion's prompt, in characters (``TextOffsets``)
    reply_id: str = field(default="", init=False)
    _offsets: TextOffsets = field(init=False)  # legacy text_offset
    # A text chunk's JSON before and after its text (see ``text``), made on first use.
    _text_parts: tuple[str, str] | None = field(default=None, init=False)
    _refusing: bool = field(default=False, init=False)  # the text is a refusal (``refusing``)

    def __post_init__(self) -> None:
        self._offsets = TextOffsets(self.text_offset_from)

    def _payload(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": completion_id(self.kind, self.reply_id),
            "object": _CHUNK_OBJECT[self.kind],
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if self.include_usage and "usage" not in payload:
            payload["usage"] = None  # as OpenAI does: null on every chunk but the last
        return payload

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> Spec:
        """A chunk with no float in it (``text_logprobs`` make theirs with ``_dumps``)."""
        return None, json_compact(self._payload(choices, **extra))

    def _choice(self, content: str | None, finish_reason: str | None, **delta: Any) -> Any:
        if self.kind == "text":
            text = content or ""
            choice = {"index": self.index, "text": text, "logprobs": None}
        else:
            if content is not None:
                delta["refusal" if self._refusing else "content"] = content
            choice = {"index": self.index, "delta": delta, "logprobs": None}
        choice["finish_reason"] = finish_reason
        return choice

    def started(self, reply_id: str) -> list[Spec]:
        self.reply_id = reply_id
        self._text_parts = None  # the id is in every chunk
        return [self._chunk([self._choice("", None, role="assistant")])]

    def admitted(self) -> list[Spec]:
        return []  # no such chunk: a chat reply says nothing of a queue

    def prompt_counted(self, tokens: int, cached: int | None) -> None:
        pass  # told in the usage chunk

    def text(self, text: str, tokens: int) -> list[Spec]:
        # Two text chunks of a reply differ only in their text: the rest is encoded once,
        # by ``_chunk`` itself, and each chunk encodes its text alone (the same bytes as
        # encoding the whole chunk, at a tenth of the cost: this runs once per event).
        # A chunk with log probabilities is not one of these (``text_logprobs``).
        parts = self._text_parts
        if parts is None:
            spec = self._chunk([self._choice(_TEXT_PLACEHOLDER, None)])[1]
            before, _, after = spec.rpartition(_TEXT_PLACEHOLDER_JSON)
            parts = self._text_parts = before, after
        # json.dumps of a str, without its two Python frames (ensure_ascii, as _chunk).
        return [(None, parts[0] + json_string(text) + parts[1])]

    def text_logprobs(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> list[Spec]:
        choice = self._choice(text, None)
        if self.kind == "chat":
            choice["logprobs"] = chat_logprobs(logprobs, refusal=self._refusing)
        else:
            choice["logprobs"] = completion_logprobs(logprobs, self._offsets)
        return [(None, _dumps(self._payload([choice])))]

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        if self.kind == "text":
            return []  # legacy completions have no tool calls (nor tools to ask for them)
        function: dict[str, Any] = {}
        call: dict[str, Any] = {"index": piece.index}
        if piece.id is not None:
            call["id"] = piece.id
        if piece.id is not None or piece.name is not None:
            call["type"] = "function"
        if piece.name is not None:
            function["name"] = piece.name
        function["arguments"] = piece.arguments
        call["function"] = function
        return [self._chunk([self._choice(None, None, tool_calls=[call])])]

    def reasoning(self, thought: str, tokens: int) -> list[Spec]:
        if self.kind == "text":
            return []  # a legacy completion is the text alone
        return [self._chunk([self._choice(None, None, reasoning_content=thought)])]

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        finish = self._chunk([self._choice(None, _finish_reason(self.kind, finish_reason))])
        return [finish] if self.one_of_many else [finish, *self.reply_end(usage)]

    def reply_end(self, usage: Usage) -> list[Spec]:
        """The end of the whole reply: the usage chunk (when asked for), then ``[DONE]``."""
        if self.include_usage:
            return [self._chunk([], usage=usage.as_dict()), DONE]
        return [DONE]

    def error(self, message: str, code: str, status: int | None = None) -> list[Spec]:
        return [in_band_error(message, code, status=status)]

    def continued(self, reason: str, tokens: int) -> list[Spec]:
        return []  # no such event in this dialect: the text simply goes on

    def refusing(self) -> list[Spec]:
        if self.kind == "chat":  # (a legacy completion's words are its text)
            self._refusing = True
            self._text_parts = None  # the text's field is another
        return []

    def moderated(self, violation: Violation, usage: Usage) -> list[Spec]:
        choice = self._choice(None, MODERATED_FINISH)
        chunk = self._chunk([choice], **{MODERATION_FIELD: moderated_payload(violation)})
        return [chunk] if self.one_of_many else [chunk, *self.reply_end(usage)]


def completion_choice(
    kind: Kind,
    index: int,
    text: str,
    finish_reason: str,
    logprobs: tuple[TokenLogprob, ...] | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
    reasoning: str = "",
    text_offset_from: int = 0,
    refusal: bool = False,
) -> dict[str, Any]:
    """One choice of a whole ``chat.completion`` or ``text_completion`` (``logprobs``: those
    of its tokens, when the request asked; ``tool_calls``: the calls it made, and
    ``reasoning``: the thinking relayed, chat only; ``text_offset_from``: a legacy
    completion's prompt, in characters, where its ``text_offset`` begin; ``refusal``: the
    text is the model's refusal, chat's ``refusal`` and no ``content``). Its log
    probabilities are ``Sliced``: the body is written by ``dumps_sliced``."""
    choice: dict[str, Any]
    refused = refusal and kind == "chat"
    if kind == "chat":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if refused else text,
            "refusal": text if refused else None,
        }
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["content"] = None if refused else text or None
            message["tool_calls"] = [call.as_openai() for call in tool_calls]
        choice = {"index": index, "message": message, "logprobs": None}
    else:
        choice = {"index": index, "text": text, "logprobs": None}
    if logprobs is not None:  # the largest part of a body by far: written in slices
        choice["logprobs"] = (
            chat_logprobs(logprobs, sliced=True, refusal=refused)
            if kind == "chat"
            else completion_logprobs(logprobs, TextOffsets(text_offset_from), sliced=True)
        )
    choice["finish_reason"] = _finish_reason(kind, finish_reason)
    return choice


def completion_body(
    kind: Kind,
    *,
    reply_id: str,
    model: str,
    created: int,
    text: str = "",
    finish_reason: str = "stop",
    usage: Usage | None,
    moderation: dict[str, object] | None = None,
    logprobs: tuple[TokenLogprob, ...] | None = None,
    choices: list[dict[str, Any]] | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
    reasoning: str = "",
    text_offset_from: int = 0,
    refusal: bool = False,
) -> dict[str, Any]:
    """A whole ``chat.completion`` or ``text_completion`` object: one choice of ``text`` (and
    ``tool_calls``, ``reasoning``, ``text_offset_from``, ``refusal``), or ``choices`` made by
    ``completion_choice``."""
    if choices is None:
        choices = [
            completion_choice(
                kind,
                0,
                text,
                finish_reason,
                logprobs,
                tool_calls,
                reasoning,
                text_offset_from,
                refusal,
            )
        ]
    body: dict[str, Any] = {
        "id": completion_id(kind, reply_id),
        "object": _BODY_OBJECT[kind],
        "created": created,
        "model": model,
        "choices": choices,
        "usage": None if usage is None else usage.as_dict(),
    }
    if moderation is not None:
        body[MODERATION_FIELD] = moderation
    return body
