"""What an upstream's OpenAI chat-completion event stream means, chunk by chunk: body bytes
in, ``Delta`` values and the upstream's failures out (sans-IO: no awaiting, no clock read but
the end of a body's).

This file decides, with nothing buffered: each body chunk is fed to
``replystream.sse.EventParser`` at once, and each content delta in it becomes a ``Delta`` (one
token each; the last delta carries the difference to the upstream's
``usage.completion_tokens`` when it sent one). The common chunk (one text delta at index 0,
or a legacy completion's text, nothing else) is read by its bytes once one was read in full:
a server writes every such chunk of a reply the same way but for its text (vLLM, SGLang and
TGI keep its id, time and model), so a read that is one whole event with the same bytes
before and after a text that needs no escaping in JSON means what the learned chunk meant
with that text, and is taken as it, with no event parse or JSON (a third of the relay's own
work per chunk, in ``benchmarks/relay/parse_cost.py``); any other read is parsed in full,
and may teach the bytes anew. A finishing choice's word for where the
upstream stopped (vLLM's ``stop_reason``, SGLang's ``matched_stop``) is not read: a reply
whose client is told which stop string ended it sends its upstream none (``upstream``), and
the others do not name it. It also decides which upstream misbehaviour ends a reply, always
as an ``UpstreamStreamError`` with its own code, within bounded memory:
- ``upstream_error``: an error object in the stream (``{"error": ...}``, vLLM and TGI style,
  or an ``error: {...}`` line, llama.cpp's server's before October 2025); one before any
  output that says the request is past the model's context is ``context_length_exceeded``;
- ``upstream_bad_chunk``: a ``data:`` payload that is not a JSON chunk object (one whose
  ``choices`` is null or absent has none: that is no failure), or ``[DONE]`` before a finish
  reason (but after tool calls whose arguments each make a JSON object, as TGI ends every
  call it streams: that reply finished with its calls). A lone UTF-16 surrogate
  escape is no failure either: Node.js's ``JSON.stringify`` writes one for each half of a
  character its server cut between two chunks. The halves are joined (a piece's high
  surrogate at its end and the low one at the start of the next piece of the same kind, into
  the one character: text, thinking, or one tool call's arguments), and any surrogate left
  alone becomes U+FFFD, as a UTF-8 decoder's bad bytes do; such an event is read again by
  ``json`` (pydantic's parser refuses a lone surrogate), the rest as before;
- ``upstream_event_too_large``: one event grew past ``max_event_size`` characters;
- ``upstream_malformed``: more than ``max_event_size`` bytes arrived without a single event;
- ``upstream_incomplete``: the body ended before ``[DONE]`` or a finish reason;
- ``upstream_empty``: it ended so with no output at all (not counted on the circuit);
- ``upstream_aborted``: a finish reason that says the upstream gave the reply up (``ABORTED``:
  vLLM's ``abort``), and ``upstream_unknown_finish``: one not known here. Neither is a reply
  finished: its text so far goes out, then the error (no dialect has a finish for either).
Messages are ours (``upstream_errors``) and name the upstream by its base URL, as the
failures before a stream do; an upstream's own words appear only quoted. Where the bytes come
from, where the deltas go and how a connection's failures are named is ``upstream_stream``'s (a
``ChunkReader`` fed by its connection); it must not know how the request was built, why its
upstream was picked, or anything about our own HTTP server.
"""

from __future__ import annotations

import codecs
import logging
import re
import secrets
import time
from collections import deque
from typing import Any

from pydantic_core import from_json

from replystream.engine.base import Delta, EngineError, ToolCallDelta
from replystream.engine.upstream_errors import quoted
from replystream.engine.upstream_logprobs import relayed_logprobs
from replystream.engine.upstream_refusals import context_exceeded
from replystream.engine.upstream_surrogates import (
    SURROGATE_ESCAPE,
    half_held_alone,
    mend,
    with_lone_surrogates,
)
from replystream.sse import Event, EventParser, EventTooLarge, SSEError

log = logging.getLogger("replystream.upstream")


def _new_call_id() -> str:
    """An id for a call its upstream gave none, in OpenAI's form."""
    return f"call_{secrets.token_hex(12)}"


# Finish reasons upstreams use for a reply they finished, mapped to ours ("stop", "length"
# or "tool_calls"; a filter passes through).
FINISH_REASONS = {
    "stop": "stop",
    "eos": "stop",
    "eos_token": "stop",  # TGI's
    "stop_sequence": "stop",
    "end_turn": "stop",  # Anthropic's words, which some proxies pass on
    "length": "length",
    "max_tokens": "length",
    "model_length": "length",  # Mistral's: the model's context is full
    "content_filter": "content_filter",
    "tool_calls": "tool_calls",
    "tool_use": "tool_calls",
    "function_call": "tool_calls",  # OpenAI's deprecated single-function form
}
# Finish reasons that say the upstream gave the reply up: vLLM's and SGLang's ``abort`` (a
# request it dropped: preempted, timed out, shut down), ``error`` (Mistral's API, vLLM's
# engine), DeepSeek's ``insufficient_system_resource``. The text before one is not the
# whole reply; nor is the text before a reason not known here, which may mean the same.
ABORTED = frozenset({"abort", "error", "insufficient_system_resource"})


# Where upstreams stream a reasoning model's thinking in a chunk's delta: ``reasoning_content``
# (DeepSeek's API, SGLang, llama.cpp, vLLM's reasoning parsers) or ``reasoning`` (newer vLLM,
# OpenRouter). It is relayed (``Delta.reasoning``) when the request asks for it, and always
# counts as the upstream's progress (``ChunkReader.thought_at``).
REASONING_KEYS = ("reasoning_content", "reasoning")
# A delta's keys whose strings are pieces a character may be cut between (``upstream_surrogates``).
_PIECE_KEYS = ("content", *REASONING_KEYS)


class UpstreamStreamError(EngineError):
    """The upstream misbehaved after its stream started (an in-band error downstream)."""

    status = 502


class StreamedRefusal(UpstreamStreamError):
    """The upstream refused the request in its stream, before any output: the request's
    fault (past the model's context), as a refusal before the stream is (a 400)."""

    status = 400


# The largest token count an upstream's usage may give: 2**53 - 1, the largest integer a
# double holds exactly, which is what a JavaScript client reads a JSON number into and what
# /metrics counters are. A real count is many orders of magnitude below it.
MAX_TOKEN_COUNT = 2**53 - 1


def _token_count(value: object) -> int | None:
    """A count from an upstream's usage, or None for what is none: not an integer (a bool is
    one in Python, not in JSON), negative, or past ``MAX_TOKEN_COUNT``."""
    return value if type(value) is int and 0 <= value <= MAX_TOKEN_COUNT else None


def _cached_count(usage: dict[str, Any], prompt_tokens: int | None) -> int | None:
    """How many of the ``prompt_tokens`` an upstream's usage says it found in its prefix
    cache (``prompt_tokens_details.cached_tokens``, OpenAI's field, which llama.cpp's
    server, vLLM and SGLang send too), or None for what is none: no such count, one
    ``_token_count`` refuses, or one past the prompt's own count (or with none)."""
    details = usage.get("prompt_tokens_details")
    cached = _token_count(details.get("cached_tokens")) if isinstance(details, dict) else None
    if cached is None or prompt_tokens is None or cached > prompt_tokens:
        return None
    return cached


def _thinks(delta: dict[str, Any]) -> bool:
    """Whether a delta carries thinking (``REASONING_KEYS``). One with text too is where a
    reasoning model's thinking ended and its answer began in one engine step (vLLM's
    reasoning parsers split that step's text at ``</think>`` into both fields of one delta):
    the thinking is its first part."""
    return bool(delta.get("reasoning_content") or delta.get("reasoning"))


def _has_output(choice: object) -> bool:
    """Whether a chunk's choice carries text or a tool call (not only a role or a reason)."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("refusal"))
    return bool(choice.get("text"))


def _message_of(error: object, withheld: tuple[str, ...]) -> str:
    """The upstream's own message in an error it sent mid-stream, quoted without the keys of
    ``withheld`` (or a placeholder): an error object's ``message`` (or ``error``, or
    ``detail``), or the error as a string."""
    message = (
        error.get("message") or error.get("error") or error.get("detail")
        if isinstance(error, dict)
        else error
    )
    if isinstance(message, str) and message.strip():
        return quoted(message, withheld=withheld)
    return "no message given"


def _error_event(data: str, withheld: tuple[str, ...]) -> tuple[str, object]:
    """What an upstream's ``event: error`` said, in words that follow its name: the message
    of its JSON object (``{"error": {...}}``, or one with a message at the top), quoted;
    never the event's own text, which may be anything (a traceback, a server's internals).
    And the error object itself (None: the event held none)."""
    try:
        body = from_json(data)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        said = (
            "reported an error mid-reply, in an event that is not a JSON object "
            f"({len(data)} characters)"
        )
        return said, None
    error = body.get("error", body)
    return f"reported an error mid-reply: {_message_of(error, withheld)}", error


def _says_context_exceeded(error: object) -> bool:
    """Whether an upstream's error object says the request is past the model's context: its
    ``code`` (else its ``type``: llama.cpp's ``exceed_context_size_error``) or its message."""
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    if not isinstance(code, str):
        code = error.get("type")
    message = error.get("message")
    return context_exceeded(
        code if isinstance(code, str) else None, message if isinstance(message, str) else None
    )


# What cannot stand in a JSON string as it is: a quote, a backslash, a control character.
_NOT_PLAIN = re.compile(rb'["\\\x00-\x1f]')
# The end of a chunk's bytes just before its text: the delta's ``content`` key, or a legacy
# completion choice's ``text``.
_CONTENT_KEY = re.compile(rb'[{,]\s*"content"\s*:\s*"$')
_TEXT_KEY = re.compile(rb'[{,]\s*"text"\s*:\s*"$')


def _plain_text(data: bytes, start: int, end: int) -> str | None:
    """``data[start:end]`` as text, if it is a JSON string's inside as it is: not empty, no
    quote, backslash or control character, valid UTF-8 (None otherwise)."""
    middle = data[start:end]
    if not middle or _NOT_PLAIN.search(middle) is not None:
        return None
    try:
        return middle.decode()
    except UnicodeDecodeError:
        return None


def _template_of(data: bytes, text: str, key: re.Pattern[bytes]) -> tuple[bytes, bytes] | None:
    """The bytes of a read that was one common text chunk, around its text: the inside of
    its string, found once, written plain, right after ``key`` (None: not so written, or not
    found once)."""
    written = text.encode()
    if _NOT_PLAIN.search(written) is not None:
        return None
    needle = b'"' + written + b'"'
    at = data.find(needle)
    if at < 0 or data.find(needle, at + 1) >= 0:
        return None
    before, after = data[: at + 1], data[at + 1 + len(written) :]
    if key.search(before[-64:]) is None:
        return None
    return before, after


class ChunkReader:
    """An upstream's reply read from its body bytes (``_take``, ``_end_of_body``) into pending
    deltas; ``upstream_stream.UpstreamStream`` is one, fed by its connection."""

    def __init__(
        self,
        *,
        name: str,
        max_event_size: int,
        withheld: tuple[str, ...] = (),
        logprobs: bool = False,
        reasoning: bool = False,
    ) -> None:
        self._where = f"the upstream at {name}"  # its base URL: every failure names it
        self._withheld = withheld  # keys its words may repeat, and ours must not
        self._logprobs = logprobs  # asked for: text without them is the upstream's failure
        self._reasoning = reasoning  # thinking is relayed, not only counted as progress
        self._max_event_size = max_event_size
        # ``error: {...}`` lines, llama.cpp's server's mid-stream error before October 2025,
        # are read as the error events they are: else only its ``[DONE]`` would be read.
        self._parser = EventParser(max_event_size=max_event_size, error_field=True)
        self._pending: deque[Delta] = deque()
        self._bytes_since_event = 0  # body bytes parsed since the last read that made an event
        self._tokens = 0
        # Thinking the request does not show: no delta, but tokens the upstream made all the
        # same, counted at the finish as its usage would count them when it sends none.
        self._hidden_tokens = 0
        # When the upstream last streamed thinking (``REASONING_KEYS``): progress, not text.
        self.thought_at = 0.0
        self._usage_tokens: int | None = None
        # Of those, the thinking (``completion_tokens_details.reasoning_tokens``), and the
        # tokens counted for the thinking relayed so far (one a piece).
        self._usage_reasoning: int | None = None
        self._relayed_reasoning = 0
        self._prompt_tokens: int | None = None  # the upstream's own count, from its usage
        self._cached_prompt_tokens: int | None = None  # of those, found in its prefix cache
        self._finish: str | None = None
        # Each tool call's id and name as its first piece named them, by its index: a later
        # piece repeating them (llama-cpp-python's server sends both on every piece) names
        # nothing new.
        self._call_names: dict[int, tuple[str, str]] = {}
        # Each tool call's arguments as they came, by its index: whether they make a whole
        # JSON object decides what a ``[DONE]`` with no finish reason after them means.
        self._call_arguments: dict[int, list[str]] = {}
        self._said_late = False  # output after the finish reason was logged (once a reply)
        self._ended = False  # the last delta was queued (or an error raised)
        self._clean = False  # the upstream finished its reply: the connection may be reused
        self._failed = False
        self._error: UpstreamStreamError | None = None  # raised once the text before it is out
        # The bytes of the last read that was one common text chunk, but for its text (before,
        # after): a read of the same bytes around another plain text is that text's chunk
        # (``_take``), read with no event parse or JSON. None: no such read yet (or the last
        # one's text needed escaping).
        self._template: tuple[bytes, bytes] | None = None
        self._common_text: str | None = None  # the text of the last read's common chunk
        self._common_key = _CONTENT_KEY  # the key of its text (chat's, or a legacy one's)
        # By kind of piece (text, thinking, a tool call's arguments), the last delta whose
        # piece ended with a character's high surrogate (its low one in the next piece of
        # that kind, as Node.js's servers cut them): held back, its piece only that
        # surrogate, until the next piece of its kind, which it goes out joined to
        # (``upstream_surrogates.mend``).
        self._held: dict[str | int, Delta] = {}

    def _fail(self, message: str, code: str) -> UpstreamStreamError:
        self._ended = self._failed = True
        return UpstreamStreamError(message, code=code)

    def _take(self, data: bytes, now: float) -> None:
        """Parse body bytes into pending deltas. A failure that ends the reply at once
        raises; one after some deltas is kept in ``_error`` (the deltas before it go out)."""
        template = self._template
        if template is not None and self._finish is None:
            before, after = template
            if data.startswith(before) and data.endswith(after) and self._parser.at_rest:
                text = _plain_text(data, len(before), len(data) - len(after))
                if text is not None:
                    # The last common chunk's bytes around another text: the same chunk.
                    self._bytes_since_event = 0
                    self._tokens += 1
                    self._pending.append(Delta(text, 1, now))
                    return
        self._common_text = None
        # The read starts an event: the stream's first (without a BOM, which a parser at
        # rest would not strip again), or one after a whole event.
        rested = self._parser.at_rest or (
            self._parser.bytes_fed == 0 and not data.startswith(codecs.BOM_UTF8)
        )
        try:
            events = self._parser.feed(data)
        except EventTooLarge:
            raise self._fail(
                f"{self._where} sent an event past {self._max_event_size} characters",
                "upstream_event_too_large",
            ) from None
        except SSEError as exc:
            raise self._fail(
                f"{self._where} sent a malformed event stream: {exc}", "upstream_malformed"
            ) from None
        if events:
            self._bytes_since_event = 0
        else:
            self._bytes_since_event += len(data)
            if self._bytes_since_event > self._max_event_size:
                raise self._fail(
                    f"{self._where} sent {self._max_event_size} bytes without one event",
                    "upstream_malformed",
                )
        try:
            for event in events:
                self._on_event(event, now)
                if self._ended:
                    return
        except UpstreamStreamError as error:  # the deltas before it still go out first
            self._error = error
            return
        text = self._common_text
        if text is not None and len(events) == 1:
            # Learned only from a read that is the one event, from its start to its end: a
            # read that went on into the next event would teach that event's first bytes as
            # part of the chunk, and a later read ending in the same bytes would lose them.
            whole = rested and self._parser.at_rest  # at rest: it ended where the event did
            self._template = _template_of(data, text, self._common_key) if whole else None

    def _end_of_body(self) -> None:
        self._parser.close()
        if self._finish is None:
            if self._tokens == 0:
                # Nothing made, and the body ended cleanly: how llama-cpp-python's server
                # answers a streamed prompt past its context, and in its chatml-function-calling
                # format a tool_choice of "auto" or "required" (it raises "Automatic streaming
                # tool choice is not supported" once the stream's head went). It may be the
                # request's fault, so it is not the upstream's failure to count
                # (``NOT_ITS_HEALTH``): three such requests from any client would otherwise
                # take the upstream out of routing.
                raise self._fail(
                    f"{self._where} ended its stream before any output or finish reason (a "
                    "request it refused without saying why: llama-cpp-python's server does "
                    "so for a prompt past its context, and for tools with a tool_choice of auto "
                    "or required in its chatml-function-calling format, which it does not "
                    "stream)",
                    "upstream_empty",
                )
            raise self._fail(
                f"{self._where} ended its stream before the reply finished", "upstream_incomplete"
            )
        self._finish_reply(time.monotonic())  # a finish reason and no [DONE] (older servers)

    def _on_event(self, event: Event, now: float) -> None:
        if event.type == "error":  # replystream's own in-band errors, and some proxies'
            said, error = _error_event(event.data, self._withheld)
            raise self._error_said(f"{self._where} {said}", error)
        data = event.data
        if data[:1] != "{" and data.strip() == "[DONE]":  # a chunk is an object: no strip
            if self._finish is None:
                if not self._calls_whole():
                    raise self._fail(
                        f"{self._where} sent [DONE] with no finish reason", "upstream_bad_chunk"
                    )
                # Tool calls, each one's arguments a whole JSON object, then the stream's own
                # end with no reason given: TGI ends every tool call so (the token after a
                # call's JSON makes no chunk), and so do some hosted services. The reply is
                # whole, and it ended with the calls. (A server that cuts a reply short with
                # [DONE], as llama-cpp-python's does for a newer request, most often leaves a
                # call's arguments unclosed: that is still a failure.)
                self._finish = "tool_calls"
            self._finish_reply(now)
            return
        try:
            # pydantic's parser (jiter): a third of json.loads's time on a chunk, and a
            # nesting bound of its own (a ValueError, where json.loads recurses).
            chunk = from_json(data)
        except ValueError:
            if SURROGATE_ESCAPE.search(data) is None:
                raise self._not_json(data) from None
            try:
                chunk = with_lone_surrogates(data, _PIECE_KEYS)
            except ValueError:
                raise self._not_json(data) from None
        else:
            if not self._held:
                self._on_chunk(chunk, now)
                return
        # A surrogate alone in it, or one held from the last: its pieces' deltas are mended.
        start = len(self._pending)
        try:
            self._on_chunk(chunk, now)
        finally:
            self._common_text = None  # its text is no template's
            if mend(self._pending, start, self._held):
                self._template = None

    def _error_said(self, said: str, error: object) -> UpstreamStreamError:
        """The failure an error object in the stream is: ``upstream_error``, but for one
        before any output that says the request is past the model's context (llama.cpp's
        server streamed that refusal, before October 2025): ``context_length_exceeded``, as
        its refusal before the stream is, which says nothing of the upstream's health (three
        over-long prompts would otherwise open its circuit, for every client)."""
        if self._tokens == 0 and self.thought_at == 0.0 and _says_context_exceeded(error):
            self._ended = self._failed = True
            return StreamedRefusal(
                f"{self._where} refused the request: {_message_of(error, self._withheld)}",
                code="context_length_exceeded",
            )
        return self._fail(said, "upstream_error")

    def _not_json(self, data: str) -> UpstreamStreamError:
        return self._fail(
            f"{self._where} sent an event that is not JSON ({len(data)} characters)",
            "upstream_bad_chunk",
        )

    def _on_chunk(self, chunk: object, now: float) -> None:
        if not isinstance(chunk, dict):
            raise self._fail(
                f"{self._where} sent a chunk that is not an object", "upstream_bad_chunk"
            )
        # The common chunk first: one choice (index 0) whose delta is text alone (a role
        # may come with it), or a legacy completion's text, no logprobs, tool calls, finish
        # reason, usage or error.
        choices = chunk.get("choices")
        if self._finish is not None:
            self._after_finish(chunk)
            return
        if type(choices) is list and len(choices) == 1 and not self._logprobs:
            choice = choices[0]
            if (
                type(choice) is dict
                and choice.get("index", 0) == 0
                and choice.get("finish_reason") is None
                and choice.get("logprobs") is None
                and chunk.get("usage") is None
                and "error" not in chunk
                and chunk.get("object") != "error"
            ):
                delta = choice.get("delta")
                if type(delta) is dict and delta.get("tool_calls") is None:
                    text = delta.get("content")
                    if type(text) is str:
                        if not text:
                            self._thinking(delta, now)
                        elif _thinks(delta):  # the thinking's end, then the answer's start
                            self._thinking(delta, now)
                            self._tokens += 1
                            self._pending.append(Delta(text, 1, now))
                        else:
                            self._tokens += 1
                            self._pending.append(Delta(text, 1, now))
                            self._common_text, self._common_key = text, _CONTENT_KEY
                        return
                elif delta is None:  # a legacy completion's chunk
                    text = choice.get("text")
                    if type(text) is str and text:
                        self._tokens += 1
                        self._pending.append(Delta(text, 1, now))
                        self._common_text, self._common_key = text, _TEXT_KEY
                        return
        if "error" in chunk or chunk.get("object") == "error":
            error = chunk.get("error", chunk)
            raise self._error_said(
                f"{self._where} reported an error mid-reply: {_message_of(error, self._withheld)}",
                error,
            )
        self._take_usage(chunk)
        if choices is None:
            # No choices, as a chunk without the field has none: a usage-only chunk that
            # some hosted OpenAI-compatible services send with null, not [] (the servers
            # run on one's own GPUs, and Azure's prompt-filter chunk, send []).
            return
        if not isinstance(choices, list):
            raise self._fail(
                f"{self._where} sent a chunk whose choices is not a list", "upstream_bad_chunk"
            )
        for choice in choices:
            delta, text = self._checked_choice(choice)
            if isinstance(delta, dict) and (not text or _thinks(delta)):
                self._thinking(delta, now)  # before the text beside it: it came first
            if text:
                logprobs = choice.get("logprobs")  # only sent when the request asked
                if logprobs:
                    made = relayed_logprobs(logprobs)
                    # Text whose list is empty carries no token of its own (the end of one
                    # an earlier chunk listed, held back as a stop string's possible start).
                    count = 1 if made is None else len(made)
                    self._tokens += count
                    self._pending.append(Delta(text, count, now, logprobs=made))
                elif self._logprobs:
                    raise self._fail(
                        f"{self._where} sent text without the logprobs asked for "
                        "(it does not support them)",
                        "upstream_no_logprobs",
                    )
                else:
                    self._tokens += 1
                    self._pending.append(Delta(text, 1, now))
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            if calls:
                self._tool_calls(calls, now)
            reason = choice.get("finish_reason")
            if reason:
                self._finish = self._finished(reason)

    def _checked_choice(self, choice: object) -> tuple[dict[str, Any] | None, str]:
        """A choice's delta (None: a legacy completion's choice) and text, once the choice is
        known to be one of the one choice asked for, each field of the type it must be: a
        choice whose text could not be read would otherwise be relayed as no text, and the
        reply reported finished without it."""
        if not isinstance(choice, dict):
            raise self._fail(
                f"{self._where} sent a choice that is not an object", "upstream_bad_chunk"
            )
        index = choice.get("index", 0)
        if index != 0 or type(index) is not int:
            raise self._fail(
                f"{self._where} sent a choice of index {quoted(str(index), 20, self._withheld)}, "
                "where one choice (index 0) was asked for",
                "upstream_bad_chunk",
            )
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            raise self._fail(
                f"{self._where} sent a choice whose delta is not an object", "upstream_bad_chunk"
            )
        field = "text" if delta is None else "content"
        text = (choice if delta is None else delta).get(field)
        if text is not None and not isinstance(text, str):
            raise self._fail(
                f"{self._where} sent a choice whose {field} is not a string", "upstream_bad_chunk"
            )
        reason = choice.get("finish_reason")
        if reason is not None and not isinstance(reason, str):
            raise self._fail(
                f"{self._where} sent a finish reason that is not a string", "upstream_bad_chunk"
            )
        return delta, text or ""

    def _finished(self, reason: str) -> str:
        """Our finish reason for the upstream's ``reason``; a failure for one that says it
        gave the reply up, or that is not known here (neither is reported as finished)."""
        finish = FINISH_REASONS.get(reason)
        if finish is not None:
            return finish
        if reason in ABORTED:
            raise self._fail(
                f"{self._where} aborted the reply (finish reason '{reason}')", "upstream_aborted"
            )
        raise self._fail(
            f"{self._where} ended the reply with a finish reason the relay does not know "
            f"('{quoted(reason, 40, self._withheld)}'), so it is not reported as finished",
            "upstream_unknown_finish",
        )

    def _after_finish(self, chunk: dict[str, Any]) -> None:
        """A chunk after the choice's finish reason: only its usage counts (the usage chunk
        comes last, as ``stream_options.include_usage`` has it). Text or a tool call there
        is outside the reply the upstream said had ended: dropped, not relayed after the
        client's own finish, and said once in the log."""
        self._take_usage(chunk)
        choices = chunk.get("choices")
        if not self._said_late and isinstance(choices, list) and any(map(_has_output, choices)):
            self._said_late = True
            log.warning("%s sent output after its finish reason; dropped it", self._where)

    def _take_usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            completion = _token_count(usage.get("completion_tokens"))
            if completion is not None:
                self._usage_tokens = completion
                details = usage.get("completion_tokens_details")
                thought = details.get("reasoning_tokens") if isinstance(details, dict) else None
                self._usage_reasoning = _token_count(thought)
                self._prompt_tokens = _token_count(usage.get("prompt_tokens"))
                self._cached_prompt_tokens = _cached_count(usage, self._prompt_tokens)

    def _thinking(self, delta: dict[str, object], now: float) -> None:
        """A delta may carry a reasoning model's thinking (alone, or before its text:
        ``_thinks``): relayed when the request asked for it, and the upstream at work either
        way (a relay's time limits count it as progress). One spelling only, the first found:
        an upstream that sends both spells the same thought twice. Or, with no text, it may
        carry a piece of the model's refusal (``_refusal``)."""
        for key in REASONING_KEYS:
            thought = delta.get(key)
            if type(thought) is str and thought:
                self.thought_at = now
                if self._reasoning:
                    self._tokens += 1
                    self._relayed_reasoning += 1
                    self._pending.append(Delta("", 1, now, reasoning=thought))
                else:
                    self._hidden_tokens += 1
                return
        refusal = delta.get("refusal")
        if type(refusal) is str and refusal:
            self._refusal(refusal, now)

    def _refusal(self, piece: str, now: float) -> None:
        """A piece of the model's refusal to answer (OpenAI's ``delta.refusal``, streamed in
        place of ``content``, most often for a reply held to a JSON form): text, after a
        marker that says so when it comes before any text or call (``Delta.refusal``), so
        the client's dialect says it as a refusal. Dropped, a refusal would read as a reply
        that finished with no text. One after text (no upstream sends one) is more text."""
        if self._tokens == self._relayed_reasoning:  # nothing but thinking before it
            self._pending.append(Delta("", 0, now, refusal=True))
        self._tokens += 1
        self._pending.append(Delta(piece, 1, now))

    def _tool_calls(self, calls: object, now: float) -> None:
        """Each ``tool_calls`` entry of a delta, as it came: one ``Delta`` (one token) each,
        its id and name only where they are new for its call, as OpenAI streams them (a client
        joins each piece's fields to the call's, and an id or name sent again would be
        doubled)."""
        if not isinstance(calls, list):
            raise self._fail(
                f"{self._where} sent tool_calls that is not a list", "upstream_bad_chunk"
            )
        for call in calls:
            function = call.get("function", {}) if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise self._fail(f"{self._where} sent a malformed tool call", "upstream_bad_chunk")
            index, call_id = call.get("index"), call.get("id") or None  # "": none
            name, arguments = function.get("name") or None, function.get("arguments") or ""
            if (
                not isinstance(index, int | None)
                or isinstance(index, bool)
                or (index is not None and index < 0)
                or not isinstance(call_id, str | None)
                or not isinstance(name, str | None)
                or not isinstance(arguments, str)
            ):
                raise self._fail(f"{self._where} sent a malformed tool call", "upstream_bad_chunk")
            if index is None:
                index = self._index_of_unnumbered(call_id, name)
            if index not in self._call_names:
                # A call is named once: a call the upstream gave no id gets one (a client
                # sends its result back by it, and Anthropic's API takes no empty id).
                self._call_names[index] = (call_id or _new_call_id(), name or "")
                call_id, name = self._call_names[index]
            else:
                # Named already: an id or name sent again (llama-cpp-python's server repeats
                # both on every piece) would be joined onto the call's by a client; a name
                # only a later piece gives is the call's.
                named_id, named = self._call_names[index]
                call_id = None
                if name is not None and not named:
                    self._call_names[index] = (named_id, name)
                else:
                    name = None
            self._call_arguments.setdefault(index, []).append(arguments)
            self._tokens += 1
            self._pending.append(
                Delta("", 1, now, tool_call=ToolCallDelta(index, call_id, name, arguments))
            )

    def _calls_whole(self) -> bool:
        """Whether some tool call came, and each one's arguments make a JSON object."""
        if not self._call_arguments:
            return False
        for pieces in self._call_arguments.values():
            try:
                arguments = from_json("".join(pieces))
            except ValueError:
                return False
            if type(arguments) is not dict:
                return False
        return True

    def _index_of_unnumbered(self, call_id: str | None, name: str | None) -> int:
        """The index of a ``tool_calls`` entry without one, as Gemini's OpenAI-compatible API
        sends them (each call whole, several in one chunk, or its arguments over several
        entries): a new call when it names one (an id other than the last call's, or a name
        while the last call has one), else a piece of the last call."""
        if not self._call_names:
            return 0
        last = max(self._call_names)
        last_id, last_name = self._call_names[last]
        if (call_id is not None and call_id != last_id) or (
            call_id is None and name is not None and last_name
        ):
            return last + 1
        return last

    def _finish_reply(self, now: float) -> None:
        for kind, held in self._held.items():  # no piece of its kind came after: alone
            self._pending.append(half_held_alone(kind, held))
        self._held.clear()
        thought = 0
        if self._usage_tokens is None:  # our count: the thinking not shown is in it too
            extra = self._hidden_tokens
        else:
            extra = max(0, self._usage_tokens - self._tokens)
            if self._reasoning and self._usage_reasoning is not None:
                # The upstream's own count of its thinking, where pieces held several tokens
                # (of the tokens its usage adds to ours, as no more than that can be).
                thought = min(extra, max(0, self._usage_reasoning - self._relayed_reasoning))
        finish = self._finish or "stop"
        self._pending.append(
            Delta(
                "",
                extra,
                now,
                finish,
                prompt_tokens=self._prompt_tokens,
                cached_prompt_tokens=self._cached_prompt_tokens,
                reasoning_tokens=thought,
            )
        )
        self._ended = self._clean = True
