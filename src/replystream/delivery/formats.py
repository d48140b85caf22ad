"""How a reply's pieces become server-sent events, one class per wire dialect.

A format returns event specs, ``(type, data)`` with ``type=None`` for a plain message; the
pipeline numbers them, and each transport writes them in its own framing. Every dialect's
first event names the reply's id (what a client needs to resume): a ``reply`` event, or, in
the OpenAI dialect, the id of its first chunk; a lab stream without event ids
(``ids=0``, the article's exact framing) has none. A failed reply ends with an ``error``
event and never with the dialect's end marker.
- The lab dialect is the reference article's: ``data: "<JSON string>"`` per event and
  ``data: [DONE]`` at the end.
- The native dialect names every event (``token``, ``tool_call``, ``usage``, ``moderated``,
  ``error``, ``done``, ``thinking`` for a reasoning model's thinking (``{"text", "tokens"}``,
  before the answer's ``token`` events), and ``continued`` where a relay carried the reply
  on at another upstream), so a client can tell an error from a finish without parsing
  JSON; ``done`` names the stop string a reply ended at (``stop_sequence``), when one did.
  A ``tool_call`` event is one piece of a call: ``{"index", "id", "name", "arguments"}``,
  with ``id`` and ``name`` only on the first piece of an index (null after). The other
  dialects have no event for a continuation: their clients read one uninterrupted text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol

from pydantic_core import PydanticSerializationError, to_json

from replystream.delivery.moderation import Violation
from replystream.delivery.replay import LogEntry
from replystream.engine.base import TokenLogprob, ToolCallDelta
from replystream.sse import encode_comment

KEEPALIVE = encode_comment("keep-alive")

Spec = tuple[str | None, str]  # (event type, None meaning "message"; data)


class Notices(Protocol):
    """A dialect's own spelling of what a reader decides and the log never holds (an
    ``error``, a ``gap``). It sees every entry its reader writes, so what it says can repeat
    what the client was sent (a Responses stream's ``response.failed`` carries the output)."""

    @property
    def tells_gaps(self) -> bool:
        """Whether the dialect has an event for lost events that a stream goes on after (no
        dialect of another API has: its reader ends with an ``events_lost`` error instead)."""
        ...

    def sent(self, entries: Sequence[LogEntry]) -> None:
        """Entries going to the socket now (a write that begins is not taken back: its
        bytes are in the socket's buffer before it waits to drain)."""
        ...

    def __call__(self, event: str, data: str, after: int) -> list[tuple[str, str]]:
        """The events to send for the reader's ``event`` and its data, after event
        ``after`` (the reader's place in the log)."""
        ...


@dataclass(frozen=True, slots=True)
class Usage:
    """A reply's token counts; ``completion_tokens`` include ``reasoning_tokens`` (thinking
    relayed), as OpenAI counts them, which are named apart only when there were some.
    ``prompt_tokens`` include ``cached_prompt_tokens``, those the engine found in its prefix
    cache (None: it did not say, and no count is named; 0 is a count, and named)."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    cached_prompt_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        counts: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_prompt_tokens is not None:  # OpenAI's own field for it
            counts["prompt_tokens_details"] = {"cached_tokens": self.cached_prompt_tokens}
        if self.reasoning_tokens:
            counts["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return counts

    def as_json(self) -> str:
        """``json.dumps(self.as_dict())``, spelt out: every streamed reply sends it."""
        if self.reasoning_tokens or self.cached_prompt_tokens is not None:
            return json.dumps(self.as_dict())
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return (
            f'{{"prompt_tokens": {prompt:d}, "completion_tokens": {completion:d}, '
            f'"total_tokens": {prompt + completion:d}}}'
        )


class StreamFormat(Protocol):
    """The events of one dialect."""

    def started(self, reply_id: str) -> list[Spec]: ...

    def admitted(self) -> list[Spec]:
        """The engine has taken the request up (``engine.base.QueuedDeltaStream``; at once,
        after ``started``, for an engine with no queue of its own): the dialect's event for
        it (a background response's ``response.in_progress``), or nothing where it has none."""
        ...

    def prompt_counted(self, tokens: int, cached: int | None) -> None:
        """The engine's own count of the prompt (``Delta.prompt_tokens``, and of those its
        ``cached_prompt_tokens``), before the events of the delta that carried it: for a
        dialect that names the count before any usage (Anthropic's ``message_start``); the
        others take it from their ending's usage."""
        ...

    def text(self, text: str, tokens: int) -> list[Spec]:
        """The events of a piece of text: one, after the events that open a text container
        first when the dialect opens one only once text comes (Anthropic's text block, a
        Responses message item). A list either way, so a plain piece costs no more than
        the one event the pipeline would put in a list itself."""
        ...

    def text_logprobs(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> list[Spec]:
        """``text`` with its tokens' log probabilities (only for a request that asked)."""
        ...

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        """The events of one piece of a tool call (see ``engine.base.ToolCallDelta``)."""
        ...

    def reasoning(self, thought: str, tokens: int) -> list[Spec]:
        """The events of a piece of a reasoning model's thinking (``Delta.reasoning``): the
        dialect's own, or nothing where it has no place for thinking."""
        ...

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        """The end of a reply that finished; ``stop_sequence``: the stop string it ended at."""
        ...

    def error(self, message: str, code: str, status: int | None = None) -> list[Spec]:
        """The end of a reply that failed: an in-band error with ``code``. ``status``: the
        HTTP status the same failure is before the stream, and asked whole (an engine's
        ``EngineError.status``), whose error type (``error_types``) a dialect that types its
        errors gives it here too; None for an ending no status tells (the reader's own)."""
        ...

    def moderated(self, violation: Violation, usage: Usage) -> list[Spec]:
        """The end of a reply a check stopped; ``usage``: the tokens made up to the one that
        completed the match, as any other ending counts them (held text, never shown,
        included)."""
        ...

    def continued(self, reason: str, tokens: int) -> list[Spec]:
        """The reply goes on at another upstream after ``tokens`` tokens (a relay's
        continuation): the dialect's marker, or nothing where it has no such event."""
        ...

    def refusing(self) -> list[Spec]:
        """The text from here on, before any text, is the model's refusal to answer
        (``Delta.refusal``): the events that say so now, if any; the text's own events and
        the ending spell it as the dialect spells a refusal (chat's ``refusal``, a Responses
        ``refusal`` part, Anthropic's ``refusal`` stop reason), or as text where it has no
        place for one."""
        ...


def error_spec(message: str, code: str) -> Spec:
    return "error", json.dumps({"error": {"message": message, "code": code}})


# In-band error codes that are the request's fault though they name no one parameter (a
# relay's upstream refusing the prompt inside its stream as past the model's context): the
# dialects' error types say so, and an SDK does not take them for the server's to retry.
REQUEST_FAULT_CODES = frozenset({"context_length_exceeded"})


def moderated_payload(violation: Violation) -> dict[str, object]:
    return {
        "check": violation.check,
        "reason": violation.reason,
        "released_chars": violation.released_chars,
        "released_tokens": violation.released_tokens,
    }


# The C routine json.dumps uses for a str: the same bytes, without building an encoder per
# call (json.dumps of a dict does, which costs more than the rest of an event's path). The
# events every reply sends are spelt out with it, byte for byte what json.dumps writes.
json_string: Callable[[str], str] = encode_basestring_ascii


def json_compact(payload: dict[str, Any]) -> str:
    """``json.dumps(payload, separators=(",", ":"))``, byte for byte, for a payload of
    strings, ints, bools, nulls, lists and dicts: no float (pydantic-core writes some floats
    in other digits, ``1e-05`` as ``0.00001``; encode those with ``json.dumps``).

    pydantic-core writes it several times faster (json.dumps builds an encoder per call,
    which costs more than encoding a chunk). Its one other difference, DEL (U+007F) left
    raw where json.dumps escapes it, is put right here (a raw DEL can only be in a string);
    a string it cannot write at all (a lone surrogate, as in a name from argv) is left to
    json.dumps."""
    try:
        encoded = to_json(payload, ensure_ascii=True).decode("ascii")
    except PydanticSerializationError:
        return json.dumps(payload, separators=(",", ":"))
    return encoded.replace("\x7f", "\\u007f")


def tool_call_spec(piece: ToolCallDelta) -> Spec:
    """A named ``tool_call`` event: the piece as it came (``id`` and ``name`` null after
    the first piece of an index), for the dialects that name their events."""
    payload = {
        "index": piece.index,
        "id": piece.id,
        "name": piece.name,
        "arguments": piece.arguments,
    }
    return "tool_call", json.dumps(payload)


def reply_spec(reply_id: str) -> Spec:
    return "reply", f'{{"reply_id": {json_string(reply_id)}}}'


class LabFormat:
    """``data: "text"`` per event, ``data: [DONE]`` at the end (the article's format)."""

    def started(self, reply_id: str) -> list[Spec]:
        return [reply_spec(reply_id)]

    def admitted(self) -> list[Spec]:
        return []

    def prompt_counted(self, tokens: int, cached: int | None) -> None:
        pass  # told in the ending's usage

    def text(self, text: str, tokens: int) -> list[Spec]:
        return [(None, json_string(text))]

    def text_logprobs(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> list[Spec]:
        return self.text(text, tokens)  # never asked: the lab routes take no logprobs

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        # The lab's routes take no tools; a scripted engine may still make calls, which
        # keep their own named event rather than pass for text.
        return [tool_call_spec(piece)]

    def reasoning(self, thought: str, tokens: int) -> list[Spec]:
        return []  # never asked: the article's stream is the answer's text alone

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        return [(None, "[DONE]")]

    def error(self, message: str, code: str, status: int | None = None) -> list[Spec]:
        return [error_spec(message, code)]  # no error type in this dialect

    def moderated(self, violation: Violation, usage: Usage) -> list[Spec]:
        return [("moderated", json.dumps(moderated_payload(violation)))]  # no usage in the lab's

    def continued(self, reason: str, tokens: int) -> list[Spec]:
        return []

    def refusing(self) -> list[Spec]:
        return []  # the article's stream is text alone: a refusal's words are its text


class NativeFormat:
    """Named events: ``reply``, ``thinking``, ``token``, ``usage``, ``moderated``, ``error``,
    ``done``, ``continued``."""

    def started(self, reply_id: str) -> list[Spec]:
        return [reply_spec(reply_id)]

    def admitted(self) -> list[Spec]:
        return []

    def prompt_counted(self, tokens: int, cached: int | None) -> None:
        pass  # told in the ending's usage

    def text(self, text: str, tokens: int) -> list[Spec]:
        # Byte for byte what json.dumps({"text": text, "tokens": tokens}) writes.
        return [("token", f'{{"text": {json_string(text)}, "tokens": {tokens:d}}}')]

    def text_logprobs(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> list[Spec]:
        return self.text(text, tokens)  # never asked: /v1/replies takes no logprobs

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        return [tool_call_spec(piece)]

    def reasoning(self, thought: str, tokens: int) -> list[Spec]:
        return [("thinking", f'{{"text": {json_string(thought)}, "tokens": {tokens:d}}}')]

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        done = f'{{"finish_reason": {json_string(finish_reason)}}}'
        if stop_sequence is not None:
            done = json.dumps({"finish_reason": finish_reason, "stop_sequence": stop_sequence})
        return [("usage", usage.as_json()), ("done", done)]

    def error(self, message: str, code: str, status: int | None = None) -> list[Spec]:
        return [error_spec(message, code)]  # no error type in this dialect

    def moderated(self, violation: Violation, usage: Usage) -> list[Spec]:
        return [("usage", usage.as_json()), ("moderated", json.dumps(moderated_payload(violation)))]

    def continued(self, reason: str, tokens: int) -> list[Spec]:
        return [("continued", json.dumps({"reason": reason, "after_tokens": tokens}))]

    def refusing(self) -> list[Spec]:
        # A relayed upstream refuses so only a reply held to a JSON form, which the native
        # routes cannot ask for: should one come, its words are the reply's tokens.
        return []
