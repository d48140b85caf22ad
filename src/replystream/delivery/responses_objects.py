"""The OpenAI Responses API's objects: a response, its output items and usage, and its id.

This file decides the shape of the ``response`` object, byte for byte alike wherever it is
told: the terminal event of a streamed response (``responses_format``), a response answered
whole, ``GET /v1/responses/{id}`` and a reader's own ``response.failed`` (``responses_log``).
Its output lists the thinking (``reasoning`` items), the text (``message`` items) and the
function calls (``function_call`` items) in the order they came, each with the status its
stream gave it. Every ``output_text`` part has its ``logprobs``, as OpenAI's do: its tokens'
when the request included them (``message.output_text.logprobs``), else ``[]``. A model's
refusal to answer (a relayed upstream's: ``Delta.refusal``) is a message whose one part is a
``refusal`` part (``{"type": "refusal", "refusal"}``, no log probabilities), as OpenAI's is.
It must not know about events, sockets, tasks or stores.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from replystream.delivery.formats import Usage
from replystream.delivery.openai_formats import logprob_entries
from replystream.delivery.reply_content import Thought, in_order
from replystream.delivery.sliced_json import Sliced, Written, dumps_written
from replystream.delivery.tool_calls import ToolCall
from replystream.engine.base import TokenLogprob

# A message's tokens' log probabilities: the tokens, or their entries as a large body or a
# stream's last events write them (``sliced_json``).
TextLogprobs = Sequence[TokenLogprob] | Sliced[TokenLogprob] | Written
# The log probabilities of each message item's text, in the order of the output's messages.
MessageLogprobs = Sequence[TextLogprobs]

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
# An output item's own status: the spec has no failed or cancelled item (OpenAI's
# ``ResponseOutputMessage``, ``ResponseFunctionToolCall`` and ``ResponseReasoningItem``).
ItemStatus = Literal["in_progress", "completed", "incomplete"]
# The finish reasons that leave a response ``incomplete``, and its ``incomplete_details``
# reason for each (OpenAI's two): the token limit, and a filter (an upstream's own; a check of
# ours ends a reply as moderated instead). Any other finish completes it.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def response_id(reply_id: str) -> str:
    """The Responses id of a reply: ``resp_<reply id>``."""
    return "resp_" + reply_id


def reply_id_of(response: str) -> str | None:
    """The reply id inside a Responses id, or None for an id not of this form."""
    return response.removeprefix("resp_") if response.startswith("resp_") else None


def compact_json(payload: dict[str, Any] | list[Any]) -> str:
    """JSON without spaces, as every event and object of this API is written (``Written``
    log probabilities put in as written)."""
    return dumps_written(payload)


@dataclass(frozen=True, slots=True)
class ResponseSettings:
    """What a response object repeats of its request."""

    model: str
    created_at: int
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    tools: tuple[dict[str, Any], ...] = ()  # the function tools offered, as the request gave them
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True
    # The request's ``reasoning``, repeated as OpenAI's response object does.
    reasoning: dict[str, Any] = field(default_factory=lambda: {"effort": None, "summary": None})
    verbosity: str | None = None  # the request's ``text.verbosity``, repeated in ``text``
    # The request's ``text.format``, repeated in ``text`` as it was given.
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    top_logprobs: int = 0  # the request's, repeated (OpenAI's objects say 0 when not asked)
    # Repeated as given (null when not): who asks, for OpenAI's abuse checks (which this
    # server has none of), and the key that keeps requests with one prefix together.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: int | None = None


# OpenAI's codes for a response's ``error`` (its clients' types hold no other); every
# failure here is the server's side of it but a rate limit an upstream passed on.
_OPENAI_ERROR_CODES = {"upstream_rate_limited": "rate_limit_exceeded"}


def response_error(code: str, message: str) -> dict[str, str]:
    """A failed response's ``error`` as OpenAI's clients read it: one of OpenAI's codes, with
    ours, which says what failed, at the end of the message (the stream's ``error`` event,
    whose code is free, carries ours as it is)."""
    return {"code": _OPENAI_ERROR_CODES.get(code, "server_error"), "message": f"{message} ({code})"}


def last_item_status(status: Status) -> ItemStatus:
    """The status of the output item open when a response reaches ``status``: its last one
    (every item before it was closed, completed, when the next one began). Cut short by the
    token limit, a check, a failure or a cancel, it is ``incomplete``."""
    if status in ("queued", "in_progress"):
        return "in_progress"
    return "completed" if status == "completed" else "incomplete"


def response_object(
    settings: ResponseSettings,
    reply_id: str,
    status: Status,
    *,
    text: str | None = None,
    usage: Usage | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, str] | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
    thoughts: tuple[Thought, ...] = (),
    logprobs: MessageLogprobs = (),
    refusal: bool = False,
) -> dict[str, Any]:
    """The ``response`` object, as ``GET /v1/responses/{id}`` and the events carry it: its
    output the thinking (reasoning items), text (message items) and calls in the order they
    came; ``logprobs``: those of each message's tokens, in order (none: ``[]``);
    ``refusal``: the text is the model's refusal (its messages' parts are ``refusal``
    parts)."""
    output: list[dict[str, Any]] = []
    pieces = [] if text is None else in_order(text, tool_calls, thoughts)
    messages = 0
    for index, piece in enumerate(pieces):
        # As the streamed ``response.output_item.done`` events said of each item.
        item_status = last_item_status(status) if index == len(pieces) - 1 else "completed"
        if isinstance(piece, str):
            made = logprobs[messages] if messages < len(logprobs) else ()
            messages += 1
            output.append(
                message_item(reply_id, len(output), piece, item_status, made, refusal=refusal)
            )
        elif isinstance(piece, Thought):
            output.append(reasoning_item(reply_id, len(output), piece.text, item_status))
        else:
            output.append(function_call_item(reply_id, piece, item_status))
    return {
        "id": response_id(reply_id),
        "object": "response",
        "created_at": settings.created_at,
        # When it completed (made now, as the terminal event's object is); null before, and
        # for any other ending, as OpenAI's.
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "background": settings.background,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "instructions": settings.instructions,
        "max_output_tokens": settings.max_output_tokens,
        "max_tool_calls": settings.max_tool_calls,
        "model": settings.model,
        "output": output,
        "parallel_tool_calls": settings.parallel_tool_calls,
        "previous_response_id": settings.previous_response_id,
        "prompt_cache_key": settings.prompt_cache_key,
        "reasoning": settings.reasoning,
        "safety_identifier": settings.safety_identifier,
        "service_tier": "default",  # the tier that served it: this server has one
        "store": settings.store,
        "temperature": settings.temperature,
        "text": _text_settings(settings),
        "tool_choice": settings.tool_choice,
        "tools": list(settings.tools),
        "top_logprobs": settings.top_logprobs,
        "top_p": settings.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else usage_object(usage),
        "user": settings.user,
        "metadata": settings.metadata or {},
    }


def _text_settings(settings: ResponseSettings) -> dict[str, Any]:
    text: dict[str, Any] = {"format": settings.text_format}
    if settings.verbosity is not None:
        text["verbosity"] = settings.verbosity
    return text


def message_id(reply_id: str, output_index: int) -> str:
    """The item id of the message at ``output_index``: ``msg_<reply id>`` first in the
    output, ``msg_<reply id>_<output index>`` after a call."""
    return f"msg_{reply_id}" if not output_index else f"msg_{reply_id}_{output_index}"


def output_text_part(text: str, logprobs: TextLogprobs = ()) -> dict[str, Any]:
    """An ``output_text`` content part, with its tokens' log probabilities (OpenAI's
    ``LogProb``: ``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
    entries = logprobs if isinstance(logprobs, Sliced | Written) else logprob_entries(logprobs)
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": entries}


def refusal_part(text: str) -> dict[str, Any]:
    """A ``refusal`` content part: the words of a model that declined to answer."""
    return {"type": "refusal", "refusal": text}


def message_item(
    reply_id: str,
    output_index: int,
    text: str,
    status: ItemStatus,
    logprobs: TextLogprobs = (),
    *,
    refusal: bool = False,
) -> dict[str, Any]:
    """A ``message`` output item of ``text`` (and its tokens' log probabilities); with
    ``refusal``, of a refusal's words (a ``refusal`` part, which has no log probabilities)."""
    part = refusal_part(text) if refusal else output_text_part(text, logprobs)
    return {
        "type": "message",
        "id": message_id(reply_id, output_index),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def split_by_message(
    text: str,
    tool_calls: tuple[ToolCall, ...],
    thoughts: tuple[Thought, ...],
    made: Sequence[TokenLogprob],
    tokens_at: Mapping[int, int],
) -> list[Sequence[TokenLogprob]]:
    """The log probabilities of a reply's text (``made``, in order), one run per message item
    of its output. ``tokens_at``: how many of them were made before the text's character
    ``n``, at each place a call or a stretch of thinking began; the last message has the
    rest (tokens with no text of their own at the end too)."""
    messages = [piece for piece in in_order(text, tool_calls, thoughts) if isinstance(piece, str)]
    runs: list[Sequence[TokenLogprob]] = []
    at = start = 0
    for number, message in enumerate(messages):
        at += len(message)
        last = number == len(messages) - 1
        end = len(made) if last else tokens_at.get(at, len(made))
        runs.append(made[start:end])
        start = end
    return runs


def reasoning_item(
    reply_id: str, output_index: int, text: str, status: ItemStatus
) -> dict[str, Any]:
    """A ``reasoning`` output item of thinking ``text``, given as it came (no summary)."""
    return {
        "type": "reasoning",
        "id": f"rs_{reply_id}_{output_index}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def function_call_item(reply_id: str, call: ToolCall, status: ItemStatus) -> dict[str, Any]:
    """A ``function_call`` output item (its item id is ours; ``call_id`` is the call's)."""
    return {
        "type": "function_call",
        "id": f"fc_{reply_id}_{call.index}",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def usage_object(usage: Usage) -> dict[str, Any]:
    """A response's ``usage``: its details always present, as OpenAI's are (0 cached when
    the engine did not say; nothing here counts tokens written to a cache)."""
    cached = usage.cached_prompt_tokens or 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
