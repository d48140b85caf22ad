"""What an event or a body means, for every reply format replystream reads.

The measuring client sees only the wire format, so it must recognise each server's way of
carrying text and of saying "finished" or "failed":
- the lab stream: ``data: "text"`` (a JSON string per event), ended by ``data: [DONE]``;
- replystream's native stream: named ``token`` events (``{"text", "tokens"}``), ended by ``done``;
- OpenAI-compatible chunks: ``choices[0].delta.content`` (chat) or ``choices[0].text``,
  ended by ``data: [DONE]``, with an ``{"error": ...}`` object for in-band failures and a
  ``usage`` chunk when asked for (a ``content_filter`` finish ends it in failure: its text was
  cut, as a native ``moderated`` event says);
- OpenAI Responses events: ``response.output_text.delta`` carries text, ``response.completed``
  and ``response.incomplete`` at the token limit end it, ``response.failed`` (or an
  ``incomplete`` for any other reason, such as a content filter) ends it in failure;
- Anthropic Messages events: a ``content_block_delta``'s ``text_delta`` carries text, the
  ``message_delta``'s ``usage.output_tokens`` the count, ``message_stop`` ends it (a
  ``refusal`` stop reason, a content filter's, in failure);
- a reasoning model's thinking, apart from its text: native ``thinking`` events, a chat
  delta's ``reasoning_content`` (or ``reasoning``), ``response.reasoning_text.delta``, a
  Messages ``thinking_delta``;
- buffered bodies: ``{"text": ...}``, an OpenAI ``chat.completion`` / ``text_completion``, a
  Responses object (its end read as its stream's terminal event is) or an Anthropic ``message``.
``event: error`` always means failure (as does llama.cpp's ``error:`` line, which the
measuring client's parser reads as one), and a terminal marker is required for success.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from replystream.sse import Event

Kind = Literal["text", "thinking", "done", "error", "usage", "gap", "other"]


@dataclass(frozen=True, slots=True)
class Meaning:
    """What one event says: text or thinking (with how many tokens it carries), the end, or
    a failure."""

    kind: Kind
    text: str = ""
    tokens: int = 0
    error: str | None = None
    # On ``done``, or on text: the server's own count of the tokens its reply made, when the
    # end (a Responses stream's last event, a buffered body) or the last text carries one.
    usage: int | None = None
    # ``tokens`` is the text's words, the nearest a reader can tell when the event carries no
    # count (the lab stream); a word split over two events is one (see ``words_added``).
    in_words: bool = False
    # ``tokens`` is the server's own count (the native events' ``tokens``), not one per event
    # or the words: what a reader's count may be held against the server's.
    counted: bool = False


# The largest event a reader takes, in characters (the parser's ``max_event_size``): a bound
# against a stream that never ends an event, not on replies. A Responses stream's closing
# events repeat the whole reply, with its log probabilities when asked for (1.5 KiB a token
# at ``top_logprobs`` 20), so a reply of 700 tokens passes 1 MiB in one event.
MAX_EVENT_CHARS = 64 << 20

# The largest token count believed from a server: beyond it a count is no count (a float
# holds every whole number up to it, so rates and means stay exact and finite).
MOST_TOKENS = 2**53

NOT_JSON_QUOTED = 80  # bytes of a body that is no JSON quoted in the error that says so


def _count(value: Any, least: int) -> int | None:
    """``value`` as a token count from ``least`` to ``MOST_TOKENS``, or None (a count that
    is not a whole number, or that no reply could have, is not believed)."""
    if isinstance(value, int) and not isinstance(value, bool) and least <= value <= MOST_TOKENS:
        return value
    return None


def server_json(data: str | bytes | bytearray) -> Any:
    """What a server sent, read as JSON; ValueError when it is none. A document nested past
    the interpreter's recursion limit (an event of a hundred thousand ``[``) is one too:
    ``json.loads`` raises RecursionError for it, which no reader expected."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


OTHER = Meaning("other")
DONE = Meaning("done")
_TERMINAL_FAILURES = frozenset({"error", "moderated"})


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict):
            message = inner.get("message") or inner.get("reason")
            code = inner.get("code") or inner.get("type")
            if message and code:
                return f"{code}: {message}"
            return str(message or code or inner)
        return str(inner)
    return str(payload)


def _first_choice(payload: dict[str, Any]) -> dict[str, Any] | None:
    """An OpenAI chunk's or body's first choice (``index`` 0, or none given), the one a
    reader of one reply reads. A stream of several choices (``n``) sends each in chunks of
    its own, so a chunk may hold another choice alone: that chunk has none of this reply."""
    choices = payload.get("choices")
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def _choice_text(payload: dict[str, Any]) -> str | None:
    choice = _first_choice(payload)
    if choice is None:
        return None
    for holder in (choice.get("delta"), choice.get("message")):
        if isinstance(holder, dict):
            content = holder.get("content")
            return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _filtered_choice(payload: dict[str, Any]) -> Meaning | None:
    """A chat or completion choice a content filter ended (``finish_reason:
    content_filter``): its text was cut, so the reply is no whole one, as a native
    ``moderated`` event and a Responses ``incomplete`` for ``content_filter`` say."""
    choice = _first_choice(payload)
    if choice is None or choice.get("finish_reason") != "content_filter":
        return None
    return Meaning("error", error="finish_reason: content_filter")


# Where chat chunks carry a reasoning model's thinking (DeepSeek's spelling, newer vLLM's).
_THINKING_KEYS = ("reasoning_content", "reasoning")


def _choice_thought(payload: dict[str, Any]) -> str | None:
    choice = _first_choice(payload)
    if choice is None:
        return None
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return None
    for key in _THINKING_KEYS:
        thought = delta.get(key)
        if isinstance(thought, str) and thought:
            return thought
    return None


def interpret_event(event: Event) -> Meaning:
    """The meaning of one parsed SSE event."""
    if event.type in _TERMINAL_FAILURES:
        try:
            detail = _error_text(server_json(event.data))
        except ValueError:
            detail = event.data[:200]  # its words, as sent (a bound: the rest is anything)
        return Meaning("error", error=f"{event.type}: {detail}")
    if event.type == "done" or event.data == "[DONE]":
        return DONE
    if event.type == "gap":  # events the server no longer had: the text read is not whole
        try:
            lost = server_json(event.data)
            said = f"events {lost['lost_from']} to {lost['lost_to']} were lost"
        except (ValueError, TypeError, KeyError):
            said = "events were lost"
        return Meaning("gap", error=f"gap: {said}")
    if event.type == "usage":
        return _usage(event.data)
    if event.type.startswith("response."):
        return _responses_event(event)
    if event.type in MESSAGES_EVENTS:
        return _messages_event(event)
    if event.type not in ("message", "token", "thinking"):
        return OTHER
    try:
        payload = server_json(event.data)
    except ValueError:
        return Meaning("error", error=f"event data is not JSON: {event.data[:80]!r}")
    if isinstance(payload, str):
        # Counted as the lab's /wait body is, so both deliveries of one reply agree, whether
        # the server sends a token per event or a batch of them.
        return Meaning("text", payload, len(payload.split()), in_words=True)
    if isinstance(payload, dict):
        if "error" in payload:
            return Meaning("error", error=_error_text(payload))
        if isinstance(payload.get("text"), str):
            tokens = _count(payload.get("tokens"), least=1)  # text is at least one token
            kind: Kind = "thinking" if event.type == "thinking" else "text"
            if tokens is None:
                return Meaning(kind, payload["text"], 1)
            return Meaning(kind, payload["text"], tokens, counted=True)
        filtered = _filtered_choice(payload)
        if filtered is not None:
            return filtered
        text = _choice_text(payload)
        # An OpenAI usage chunk; or, from some servers (llama.cpp's, before it sent one of its
        # own), the usage in the chunk of the finish reason, or of the last text.
        reported = _completion_tokens(payload.get("usage"))
        if not text and (thought := _choice_thought(payload)) is not None:
            return Meaning("thinking", thought, 1)
        if text:
            return Meaning("text", text, 1, usage=reported)
        if reported is not None:
            return Meaning("usage", tokens=reported)
        if text is not None:
            return Meaning("text", "", 0)
    return OTHER


def words_added(before: str, text: str) -> int:
    """The words ``text`` adds to a reply that so far ended with ``before`` (its last
    characters will do): its own, less one when it goes on with a word ``before`` ended in."""
    words = len(text.split())
    goes_on = before[-1:].strip() and text[:1].strip()
    return words - 1 if goes_on and words else words


# A Responses stream ends with one of these; ``incomplete`` at the token limit is a whole reply
# (as a chat completion that stopped at max_tokens is).
RESPONSES_ENDED = frozenset({"response.completed", "response.incomplete", "response.failed"})
_RESPONSES_DELTAS: dict[str, Kind] = {
    "response.output_text.delta": "text",
    "response.reasoning_text.delta": "thinking",
}


def _object_of(event: Event) -> dict[str, Any] | Meaning:
    """A typed event's data, a JSON object; or the error its data is."""
    try:
        payload = server_json(event.data)
    except ValueError:
        return Meaning("error", error=f"event data is not JSON: {event.data[:80]!r}")
    if not isinstance(payload, dict):
        return Meaning("error", error=f"{event.type} data is not an object")
    return payload


def _responses_event(event: Event) -> Meaning:
    if event.type not in RESPONSES_ENDED and event.type not in _RESPONSES_DELTAS:
        return OTHER
    payload = _object_of(event)
    if isinstance(payload, Meaning):
        return payload
    if event.type in _RESPONSES_DELTAS:
        delta = payload.get("delta")
        kind = _RESPONSES_DELTAS[event.type]
        return Meaning(kind, delta, 1) if isinstance(delta, str) and delta else OTHER
    response = payload.get("response")
    return _response_ending(event.type, response if isinstance(response, dict) else {})


def _response_ending(ending: str, response: dict[str, Any]) -> Meaning:
    """What a Responses object says of its end, told by ``ending`` (a terminal event's type,
    or ``response.`` and the status of an object answered whole)."""
    usage = response.get("usage")
    made = _count(usage.get("output_tokens"), least=0) if isinstance(usage, dict) else None
    if ending == "response.completed":
        return Meaning("done", usage=made)
    if ending == "response.incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        if reason == "max_output_tokens":
            return Meaning("done", usage=made)
        return Meaning("error", error=f"response.incomplete: {reason or 'no reason given'}")
    # A cancelled response ends ``response.failed`` with ``error: null``: its status says why.
    error = response.get("error")
    said = _error_text(error) if error is not None else response.get("status", "no error given")
    return Meaning("error", error=f"{ending}: {said}")


def _response_object(response: dict[str, Any]) -> Meaning:
    """A whole Responses object (``POST /v1/responses`` not streamed): its output text, and
    its end read as the stream's terminal event is (its ``error`` is null unless it failed)."""
    status = response.get("status")
    ending = "response.failed" if status == "cancelled" else f"response.{status}"
    if ending not in RESPONSES_ENDED:  # queued or in progress: answered before its end
        return Meaning("error", error=f"response {status}: no reply yet")
    meaning = _response_ending(ending, response)
    if meaning.kind != "done":
        return meaning
    output = response.get("output")
    pieces: list[str] = []
    for item in output if isinstance(output, list) else []:
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, list) or item.get("type") != "message":
            continue  # a function call or thinking: no text of the answer
        for part in content:
            if isinstance(part, dict) and part.get("type") == "output_text":
                text = part.get("text")
                pieces.append(text if isinstance(text, str) else "")
    return Meaning("done", "".join(pieces), usage=meaning.usage)


# The Anthropic Messages events that say something here (the rest: ``message_start``, a block's
# start and stop, ``ping``, say nothing of text or its end), and the deltas that carry text
# or thinking, with the field each keeps it in.
MESSAGES_EVENTS = frozenset({"content_block_delta", "message_delta", "message_stop"})
_MESSAGES_DELTAS: dict[str, tuple[Kind, str]] = {
    "text_delta": ("text", "text"),
    "thinking_delta": ("thinking", "thinking"),
}


# A Messages reply a content filter ended (Anthropic's streaming classifiers, or a check here):
# its text was cut, so it is no whole reply, as a chat ``content_filter`` finish is not.
REFUSED = "refusal"


def _refused() -> Meaning:
    return Meaning("error", error=f"stop_reason: {REFUSED}")


def _messages_event(event: Event) -> Meaning:
    if event.type == "message_stop":
        return DONE
    payload = _object_of(event)
    if isinstance(payload, Meaning):
        return payload
    if event.type == "message_delta":  # its usage counts the whole reply's output so far
        delta = payload.get("delta")
        if isinstance(delta, dict) and delta.get("stop_reason") == REFUSED:
            return _refused()
        usage = payload.get("usage")
        made = _count(usage.get("output_tokens"), least=0) if isinstance(usage, dict) else None
        return OTHER if made is None else Meaning("usage", tokens=made)
    delta = payload.get("delta")
    named = delta.get("type") if isinstance(delta, dict) else None
    carried = _MESSAGES_DELTAS.get(named) if isinstance(named, str) else None
    if not isinstance(delta, dict) or carried is None:  # a tool call's JSON, a signature
        return OTHER
    kind, field = carried
    piece = delta.get(field)
    return Meaning(kind, piece, 1) if isinstance(piece, str) and piece else OTHER


def _usage(source: str | dict[str, Any]) -> Meaning:
    """The server's own count of the tokens its model made (native ``usage`` event, OpenAI
    chunk): what a benchmark divides time by, as vLLM's does. Text a moderator withheld is
    counted in it and never sent, so it can be more than the text events read."""
    try:
        usage = server_json(source) if isinstance(source, str) else source
    except ValueError:
        return OTHER
    tokens = _completion_tokens(usage)
    return OTHER if tokens is None else Meaning("usage", tokens=tokens)


def _completion_tokens(usage: Any) -> int | None:
    return _count(usage.get("completion_tokens"), least=0) if isinstance(usage, dict) else None


def interpret_body(body: bytes | bytearray) -> Meaning:
    """The reply text in a complete buffered JSON body (``done``, with the body's
    ``usage.completion_tokens`` when it has one), or why there is none."""
    try:
        payload = server_json(body)
    except ValueError:
        return Meaning("error", error=_not_json(body))
    if isinstance(payload, dict):
        if payload.get("object") == "response":  # its ``error`` key is there, null or not
            return _response_object(payload)
        if "error" in payload:
            return Meaning("error", error=_error_text(payload))
        if payload.get("finish_reason") == "moderated":
            return Meaning("error", error=f"moderated: {_error_text(payload.get('moderation'))}")
        usage = payload.get("usage")
        made = _count(usage.get("completion_tokens"), 0) if isinstance(usage, dict) else None
        if isinstance(payload.get("text"), str):
            return Meaning("done", payload["text"], usage=made)
        filtered = _filtered_choice(payload)
        if filtered is not None:
            return filtered
        text = _choice_text(payload)
        if text is not None:
            return Meaning("done", text, usage=made)
        if payload.get("type") == "message" and isinstance(payload.get("content"), list):
            return _anthropic_message(payload)
    return Meaning("error", error="body holds no reply text")


def _not_json(body: bytes | bytearray) -> str:
    """Why a body holds no JSON: one begun and cut short, or something else (a proxy's
    HTML error page, say), quoted from its start so that a reader can tell what answered."""
    start = bytes(body[:NOT_JSON_QUOTED]).lstrip()
    if not start or start[:1] in (b"{", b"["):
        return f"body is not complete JSON ({len(body):,} bytes)"
    quoted = " ".join(start.decode("utf-8", "replace").split())
    more = "..." if len(body) > NOT_JSON_QUOTED else ""
    return f"body is not JSON ({len(body):,} bytes, beginning {quoted!r}{more})"


def _anthropic_message(message: dict[str, Any]) -> Meaning:
    """A whole Anthropic ``message``: its text blocks' text, and ``usage.output_tokens``."""
    if message.get("stop_reason") == REFUSED:
        return _refused()
    blocks = [b for b in message["content"] if isinstance(b, dict) and b.get("type") == "text"]
    text = "".join(b["text"] for b in blocks if isinstance(b.get("text"), str))
    usage = message.get("usage")
    made = _count(usage.get("output_tokens"), 0) if isinstance(usage, dict) else None
    return Meaning("done", text, usage=made)
