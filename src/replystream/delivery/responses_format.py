"""The OpenAI Responses dialect: typed events of one response, and its whole-response object.

This file decides what a Responses client (``client.responses`` of the openai SDK, agent
frameworks) reads, byte for byte:
- A streamed response is ``event: <type>`` with a ``data:`` object whose ``type`` matches and
  whose ``sequence_number`` is the event's id in the reply log (the same cursor for
  ``starting_after`` and ``Last-Event-ID``), in OpenAI's order: ``response.created``,
  ``response.in_progress``, then the output items in order (a message:
  ``response.output_item.added``, ``response.content_part.added``, one
  ``response.output_text.delta`` per piece of text, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``), then the terminal event:
  ``response.completed`` (with usage), ``response.incomplete`` (with usage; the token limit,
  or a check that stopped the text: ``content_filter``) or ``response.failed`` (with the
  error). There is no ``[DONE]``: the terminal event ends the stream.
- A message item is opened when text comes (a response of calls only has none), and closed
  when a call starts or the response ends; text after a call opens a new message item
  (``msg_<reply id>`` first in the output, ``msg_<reply id>_<output index>`` after a call).
- A tool call is a ``function_call`` output item: the open item is closed (its ``.done``
  events), then ``response.output_item.added`` (``type: "function_call"``, ``call_id``,
  ``name``, ``arguments: ""``), one ``response.function_call_arguments.delta`` per fragment,
  and when the next item starts or the response ends
  ``response.function_call_arguments.done`` (the whole arguments) and
  ``response.output_item.done``. The whole response's ``output`` has the same items in the
  same order.
- A reasoning model's thinking, relayed, is a ``reasoning`` output item (``rs_<reply id>_<output
  index>``), as vLLM and the open-weight models' servers stream it: ``response.output_item.
  added``, ``response.content_part.added`` (a ``reasoning_text`` part), one
  ``response.reasoning_text.delta`` per piece, then ``response.reasoning_text.done``,
  ``response.content_part.done`` and ``response.output_item.done`` when text or a call
  comes. Its ``summary`` is empty and it has no ``encrypted_content``: the thinking is given
  as it came. The usage counts its tokens in ``output_tokens_details.reasoning_tokens``.
- The same response whole, not streamed, is the object the terminal event carries.
A format object serves one response: it numbers its events as the pipeline will (one per
spec, from 1), and keeps the text so far, which the closing events repeat. It must not know
about sockets, tasks or stores.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from replystream.delivery.formats import Spec, Usage, json_string, moderated_payload
from replystream.delivery.moderation import Violation
from replystream.delivery.replay import LogEntry
from replystream.delivery.reply_content import Thought, Thoughts, in_order
from replystream.delivery.tool_calls import ToolCall, ToolCalls
from replystream.engine.base import TokenLogprob, ToolCallDelta

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
# An output item's own status: the spec has no failed or cancelled item (OpenAI's
# ``ResponseOutputMessage``, ``ResponseFunctionToolCall`` and ``ResponseReasoningItem``).
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def response_id(reply_id: str) -> str:
    """The Responses id of a reply: ``resp_<reply id>``."""
    return "resp_" + reply_id


def reply_id_of(response: str) -> str | None:
    """The reply id inside a Responses id, or None for an id not of this form."""
    return response.removeprefix("resp_") if response.startswith("resp_") else None


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"))


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
) -> dict[str, Any]:
    """The ``response`` object, as ``GET /v1/responses/{id}`` and the events carry it: its
    output the thinking (reasoning items), text (message items) and calls in the order they
    came."""
    output: list[dict[str, Any]] = []
    pieces = [] if text is None else in_order(text, tool_calls, thoughts)
    for index, piece in enumerate(pieces):
        # As the streamed ``response.output_item.done`` events said of each item.
        item_status = last_item_status(status) if index == len(pieces) - 1 else "completed"
        if isinstance(piece, str):
            output.append(message_item(reply_id, len(output), piece, item_status))
        elif isinstance(piece, Thought):
            output.append(reasoning_item(reply_id, len(output), piece.text, item_status))
        else:
            output.append(function_call_item(reply_id, piece, item_status))
    return {
        "id": response_id(reply_id),
        "object": "response",
        "created_at": settings.created_at,
        "status": status,
        "background": settings.background,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "instructions": settings.instructions,
        "max_output_tokens": settings.max_output_tokens,
        "model": settings.model,
        "output": output,
        "parallel_tool_calls": settings.parallel_tool_calls,
        "previous_response_id": settings.previous_response_id,
        "reasoning": settings.reasoning,
        "store": settings.store,
        "temperature": settings.temperature,
        "text": _text_settings(settings),
        "tool_choice": settings.tool_choice,
        "tools": list(settings.tools),
        "top_p": settings.top_p,
        "truncation": "disabled",
        "usage": None if usage is None else usage_object(usage),
        "metadata": settings.metadata or {},
    }


def _text_settings(settings: ResponseSettings) -> dict[str, Any]:
    text: dict[str, Any] = {"format": {"type": "text"}}
    if settings.verbosity is not None:
        text["verbosity"] = settings.verbosity
    return text


def message_id(reply_id: str, output_index: int) -> str:
    """The item id of the message at ``output_index``: ``msg_<reply id>`` first in the
    output, ``msg_<reply id>_<output index>`` after a call."""
    return f"msg_{reply_id}" if not output_index else f"msg_{reply_id}_{output_index}"


def message_item(reply_id: str, output_index: int, text: str, status: ItemStatus) -> dict[str, Any]:
    """A ``message`` output item of ``text``."""
    return {
        "type": "message",
        "id": message_id(reply_id, output_index),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


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
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass(slots=True)
class ResponsesStreamFormat:
    """The typed events of one streamed response (a ``StreamFormat``)."""

    settings: ResponseSettings
    _reply_id: str = ""
    _next: int = 1  # the sequence number the pipeline gives the next spec
    _text: list[str] = field(default_factory=list)
    _delta_head: str = ""  # a text delta's JSON up to its number, for the open message
    _calls: ToolCalls = field(default_factory=ToolCalls)
    _items: int = 0  # output items started so far
    _open_call: ToolCall | None = None  # the function call item open now, if any
    _open_message: int | None = None  # the output index of the message open now, if any
    _message_from: int = 0  # where the open message's text starts in ``_text``
    _call_index: dict[int, int] = field(default_factory=dict)  # call index -> output index
    _thoughts: Thoughts = field(default_factory=Thoughts)
    _open_thought: tuple[int, Thought] | None = None  # the reasoning item open now, if any

    def _event(self, kind: str, payload: dict[str, Any]) -> Spec:
        number = self._next
        self._next += 1
        return kind, _dumps({"type": kind, "sequence_number": number, **payload})

    def _response(self, status: Status, **details: Any) -> dict[str, Any]:
        text = "".join(self._text)
        calls = self._calls.whole()
        thoughts = self._thoughts.whole()
        return response_object(
            self.settings,
            self._reply_id,
            status,
            text=text,
            tool_calls=calls,
            thoughts=thoughts,
            **details,
        )

    def started(self, reply_id: str) -> list[Spec]:
        self._reply_id = reply_id
        empty = response_object(self.settings, reply_id, "in_progress")
        # A background response is queued first (it runs whoever reads it).
        opening = (
            [
                self._event("response.created", {"response": {**empty, "status": "queued"}}),
                self._event("response.queued", {"response": {**empty, "status": "queued"}}),
            ]
            if self.settings.background
            else [self._event("response.created", {"response": empty})]
        )
        return [*opening, self._event("response.in_progress", {"response": empty})]

    def text(self, text: str, tokens: int) -> list[Spec]:
        if self._open_message is not None:
            self._text.append(text)
            number = self._next
            self._next += 1
            # Spelt out: one per piece of text, the event every response sends most.
            delta = (self._delta_head % number) + json_string(text) + ',"logprobs":[]}'
            return [("response.output_text.delta", delta)]
        if not text:
            return []  # no message is opened for no text
        specs = self._open_item_message()
        return specs + self.text(text, tokens)

    def _open_item_message(self) -> list[Spec]:
        """Close the open call, if any, and open a message item."""
        specs = self._close_open("completed")
        output_index = self._open_message = self._items
        self._items += 1
        self._message_from = len(self._text)
        item_id = message_id(self._reply_id, output_index)
        self._delta_head = (
            f'{{"type":"response.output_text.delta","sequence_number":%d,'
            f'"item_id":"{item_id}","output_index":{output_index},"content_index":0,"delta":'
        )
        item = {
            "type": "message",
            "id": item_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": item_id, "output_index": output_index, "content_index": 0}
        return [
            *specs,
            self._event("response.output_item.added", {"output_index": output_index, "item": item}),
            self._event("response.content_part.added", {**where, "part": part}),
        ]

    def text_logprobs(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> list[Spec]:
        return self.text(text, tokens)  # never asked: /v1/responses takes no logprobs

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        call = self._calls.calls.get(piece.index)
        specs: list[Spec] = []
        if call is None:  # a new call: close the item open now, then add a function_call item
            specs = self._close_open("completed")
            call = self._calls.add(piece, sum(map(len, self._text)))
            self._call_index[call.index] = self._items
            self._items += 1
            self._open_call = call
            item = function_call_item(self._reply_id, call, "in_progress")
            item["arguments"] = ""
            specs.append(
                self._event(
                    "response.output_item.added",
                    {"output_index": self._call_index[call.index], "item": item},
                )
            )
        else:
            self._calls.add(piece)
        if piece.arguments:
            where = {
                "item_id": f"fc_{self._reply_id}_{call.index}",
                "output_index": self._call_index[call.index],
            }
            specs.append(
                self._event(
                    "response.function_call_arguments.delta", {**where, "delta": piece.arguments}
                )
            )
        return specs

    def reasoning(self, thought: str, tokens: int) -> list[Spec]:
        specs: list[Spec] = []
        if self._open_thought is None:  # close the item open now, then add a reasoning item
            specs = self._close_open("completed")
        text_at = sum(map(len, self._text))
        stretch, began = self._thoughts.add(thought, text_at, len(self._calls.calls))
        if began:
            output_index = self._items
            self._items += 1
            self._open_thought = output_index, stretch
            item = reasoning_item(self._reply_id, output_index, "", "in_progress")
            item["content"] = []
            part = {"type": "reasoning_text", "text": ""}
            where = {"item_id": item["id"], "output_index": output_index, "content_index": 0}
            specs += [
                self._event(
                    "response.output_item.added", {"output_index": output_index, "item": item}
                ),
                self._event("response.content_part.added", {**where, "part": part}),
            ]
        assert self._open_thought is not None
        output_index = self._open_thought[0]
        where = {
            "item_id": f"rs_{self._reply_id}_{output_index}",
            "output_index": output_index,
            "content_index": 0,
        }
        specs.append(self._event("response.reasoning_text.delta", {**where, "delta": thought}))
        return specs

    def _close_open(self, status: ItemStatus) -> list[Spec]:
        """The closing events of the item open now, if any: thinking, a message, or a call."""
        thought = self._open_thought
        if thought is not None:
            self._open_thought = None
            self._thoughts.interrupt()
            output_index, stretch = thought
            item = reasoning_item(self._reply_id, output_index, stretch.text, status)
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": output_index, "content_index": 0}
            return [
                self._event("response.reasoning_text.done", {**where, "text": stretch.text}),
                self._event("response.content_part.done", {**where, "part": part}),
                self._event(
                    "response.output_item.done", {"output_index": output_index, "item": item}
                ),
            ]
        call = self._open_call
        if call is not None:
            self._open_call = None
            output_index = self._call_index[call.index]
            item = function_call_item(self._reply_id, call, status)
            where = {"item_id": item["id"], "output_index": output_index}
            arguments = {**where, "arguments": call.arguments}
            return [
                self._event("response.function_call_arguments.done", arguments),
                self._event(
                    "response.output_item.done", {"output_index": output_index, "item": item}
                ),
            ]
        message = self._open_message
        if message is None:
            return []
        self._open_message = None
        text = "".join(self._text[self._message_from :])
        item = message_item(self._reply_id, message, text, status)
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": message, "content_index": 0}
        return [
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**where, "part": part}),
            self._event("response.output_item.done", {"output_index": message, "item": item}),
        ]

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        if finish_reason == "length":
            details = {"usage": usage, "incomplete_reason": "max_output_tokens"}
            return [
                *self._close_open("incomplete"),
                self._event(
                    "response.incomplete", {"response": self._response("incomplete", **details)}
                ),
            ]
        return [
            *self._close_open("completed"),
            self._event(
                "response.completed", {"response": self._response("completed", usage=usage)}
            ),
        ]

    def error(self, message: str, code: str) -> list[Spec]:
        status: Status = "cancelled" if code == "cancelled" else "failed"
        error = {"code": code, "message": message}
        kind = "response.failed"
        return [self._event(kind, {"response": self._response(status, error=error)})]

    def continued(self, reason: str, tokens: int) -> list[Spec]:
        return []  # no such event in this dialect: the text simply goes on

    def moderated(self, violation: Violation, usage: Usage) -> list[Spec]:
        response = self._response("incomplete", usage=usage, incomplete_reason="content_filter")
        response["replystream_moderation"] = moderated_payload(violation)
        return [
            *self._close_open("incomplete"),
            self._event("response.incomplete", {"response": response}),
        ]


TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def response_from_log(entries: Sequence[LogEntry], *, producer_lost: bool) -> dict[str, Any] | None:
    """A response object as its log tells it so far: the terminal event's when it has ended;
    else the one ``response.created`` carried, with the text so far (``failed``, naming the
    lost generator, when the producing replica is gone). None: not a response's log."""
    for entry in reversed(entries):
        if entry.event in TERMINAL:
            response: dict[str, Any] = json.loads(entry.data)["response"]
            return response
    created: dict[str, Any] | None = None
    started = False
    for entry in entries:
        if entry.event == "response.created":
            created = json.loads(entry.data)["response"]
        elif entry.event == "response.in_progress":
            started = True
    if created is None:
        return None
    status = "in_progress" if started else created["status"]
    if producer_lost:
        message = "the replica generating this response is gone"
        created["error"] = {"code": "generator_lost", "message": message}
        status = "failed"
    created["status"] = status
    if started:
        created["output"] = output_from_log(entries, cut=status != "in_progress")
    return created


ITEM_EVENTS = frozenset(
    {
        "response.output_item.added",
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "response.output_item.done",
    }
)


def output_from_log(entries: Iterable[LogEntry], *, cut: bool) -> list[dict[str, Any]]:
    """The output items (thinking, messages, function calls) that logged events tell, in
    order. ``cut``: the response ended without closing its open item, which is then
    ``incomplete`` (a call's too), as the producer's own ending would have made it."""
    items: dict[str, dict[str, Any]] = {}  # by item id, in order
    for entry in entries:
        if entry.event in ITEM_EVENTS:
            _follow_item(items, entry.event, json.loads(entry.data))
    if cut:
        for item in items.values():
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
    return list(items.values())


def _follow_item(items: dict[str, dict[str, Any]], event: str, payload: dict[str, Any]) -> None:
    """An output item as its logged events tell it so far (a piece of an item whose opening
    is not among them, read from after it, is left out)."""
    if event in ("response.output_text.delta", "response.reasoning_text.delta"):
        item = items.get(payload["item_id"])
        if item is not None:
            item["content"][0]["text"] += payload["delta"]
    elif event == "response.function_call_arguments.delta":
        item = items.get(payload["item_id"])
        if item is not None:
            item["arguments"] += payload["delta"]
    else:
        item = dict(payload["item"])
        if item["type"] == "message" and not item["content"]:  # added: its text comes next
            item["content"] = [{"type": "output_text", "text": "", "annotations": []}]
        elif item["type"] == "reasoning" and not item["content"]:
            item["content"] = [{"type": "reasoning_text", "text": ""}]
        items[item["id"]] = item


def opened_object(first: LogEntry) -> dict[str, Any] | None:
    """The response object a response's first logged event carried, if that event is its
    ``response.created`` (None: trimmed, or another event)."""
    if first.event != "response.created":
        return None
    opened: dict[str, Any] = json.loads(first.data)["response"]
    return opened


class ReaderNotices:
    """How a Responses stream spells what its reader decides (a slow client, a lost
    producer, a store that cannot be reached): an ``error`` event in OpenAI's shape, then
    ``response.failed``, numbered on from the last event written (they are not in the log).
    Its object is the response as it opened (its settings, as ``response.created`` carried
    them), failed, with the output items this stream has told its client (the open one
    cut: ``incomplete``), so a client that puts the response together from the events has
    what the failure says. A reader that resumed starts from the entries before its place
    (``told``)."""

    __slots__ = ("_opened", "_reply_id", "_told")

    def __init__(
        self, reply_id: str, opened: dict[str, Any] | None, told: Sequence[LogEntry] = ()
    ) -> None:
        self._reply_id = reply_id
        self._opened = opened  # None: its ``response.created`` is gone from the log
        # References to entries the log holds anyway; read only if the reader decides.
        self._told = list(told)

    def sent(self, entries: Sequence[LogEntry]) -> None:
        self._told += entries

    def __call__(self, event: str, data: str, after: int) -> list[tuple[str, str]]:
        if event != "error":
            return [(event, data)]
        if self._told:  # a write that did not drain is sent all the same, before these
            after = max(after, self._told[-1].seq)
        error = json.loads(data)["error"]
        code, message = error["code"], error["message"]
        opened = self._opened or {"id": response_id(self._reply_id), "object": "response"}
        failed = {
            **opened,
            "status": "failed",
            "error": {"code": code, "message": message},
            "incomplete_details": None,
            "output": output_from_log(self._told, cut=True),
            "usage": None,
        }
        error_event = {
            "type": "error",
            "sequence_number": after + 1,
            "code": code,
            "message": message,
            "param": None,
        }
        failed_event = {"type": "response.failed", "sequence_number": after + 2, "response": failed}
        return [("error", _dumps(error_event)), ("response.failed", _dumps(failed_event))]
