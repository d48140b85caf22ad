"""A response as its log tells it: the object ``GET /v1/responses/{id}`` answers, and what a
reader says when it ends a stream alone.

A response's log holds the events its stream sent (``responses_format``). This file reads
them back: the terminal event's object once the response has ended; before that, the object
``response.created`` carried with the output items the events so far tell. A reader that
ends a stream on its own (a slow client, a lost producer, a store out of reach) says so with
events that are not in the log, whose ``response.failed`` carries the output that reader
told its client. It must not know about sockets, tasks or which store keeps the log.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from replystream.delivery.replay import LogEntry
from replystream.delivery.responses_objects import (
    compact_json,
    output_text_part,
    refusal_part,
    response_error,
    response_id,
)

TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
# A terminal event as ``ResponsesStreamFormat`` writes it, up to its ``response``: the last
# (and only other) field, so the rest of the event, but its closing brace, is the object.
_TERMINAL_HEAD = re.compile(r'\{"type":"response\.[a-z]+","sequence_number":\d+,"response":\{')


def response_json_from_log(entries: Sequence[LogEntry], *, producer_lost: bool) -> str | None:
    """``response_from_log``'s object as compact JSON. An ended response's is the text its
    terminal event holds, not parsed and written again: with log probabilities it can be
    megabytes, and a parse and a write of it would hold the loop."""
    for entry in reversed(entries):
        if entry.event in TERMINAL:
            head = _TERMINAL_HEAD.match(entry.data)
            if head is not None and entry.data.endswith("}"):
                return entry.data[head.end() - 1 : -1]
            break  # written some other way: parsed
    response = response_from_log(entries, producer_lost=producer_lost)
    return None if response is None else compact_json(response)


# How a non-empty ``logprobs`` list begins in compact JSON; a text holds it only as a field's
# name and value (inside a JSON string its quotes would be escaped).
_LISTED_LOGPROBS = '"logprobs":[{'


def without_logprobs_json(text: str) -> str:
    """A response object (compact JSON) as a request that does not include log probabilities
    sees it (``without_logprobs``); the text itself when it lists none."""
    if _LISTED_LOGPROBS not in text:
        return text
    return compact_json(without_logprobs(json.loads(text)))


def without_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    """A response object as one made without ``message.output_text.logprobs`` included
    has it: each ``output_text`` part's ``logprobs`` ``[]`` (there, as OpenAI's parts have
    it). Changed in place."""
    for item in response.get("output") or ():
        if item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if part.get("type") == "output_text" and part.get("logprobs"):
                part["logprobs"] = []
    return response


GENERATOR_LOST = "the replica generating this response is gone"


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
        created["error"] = response_error("generator_lost", GENERATOR_LOST)
        status = "failed"
    created["status"] = status
    if started:
        created["output"] = output_from_log(entries, cut=status != "in_progress")
    return created


ITEM_EVENTS = frozenset(
    {
        "response.output_item.added",
        "response.output_text.delta",
        "response.refusal.delta",
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
    elif event == "response.refusal.delta":  # a message whose part is a refusal
        item = items.get(payload["item_id"])
        if item is not None:
            if item["content"][0]["type"] != "refusal":
                item["content"][0] = refusal_part("")
            item["content"][0]["refusal"] += payload["delta"]
    elif event == "response.function_call_arguments.delta":
        item = items.get(payload["item_id"])
        if item is not None:
            item["arguments"] += payload["delta"]
    else:
        item = dict(payload["item"])
        if item["type"] == "message" and not item["content"]:  # added: its text comes next
            # Its tokens' log probabilities come whole with its ``.done`` events (a delta's
            # have no ``bytes``, which a part's must have).
            item["content"] = [output_text_part("")]
        elif item["type"] == "reasoning" and not item["content"]:
            item["content"] = [{"type": "reasoning_text", "text": ""}]
        items[item["id"]] = item


# Events read between two turns of the loop, where an ended response's output is read from
# its small events (a text delta with 20 log probabilities is about 1.4 KB).
SAID_SLICE = 64


class Call(NamedTuple):
    """A function call a response made, as a conversation holds it."""

    call_id: str
    name: str
    arguments: str


class Said(NamedTuple):
    """What a response said, as the next turn's assistant message takes it: its messages'
    text (or a refusal's words), joined, and its function calls, in order."""

    text: str
    calls: list[Call]


def said_in_object(response: dict[str, Any]) -> Said:
    """What a response object's output says."""
    output = response["output"]
    text = "".join(
        part["text"] if part.get("type") == "output_text" else part["refusal"]
        for item in output
        if item.get("type") == "message"
        for part in item.get("content", [])
        if part.get("type") in ("output_text", "refusal")
    )
    calls = [
        Call(item["call_id"], item["name"], item["arguments"])
        for item in output
        if item.get("type") == "function_call"
    ]
    return Said(text, calls)


async def said_in_events(entries: Sequence[LogEntry]) -> Said:
    """What an ended response said, read from its whole log's small events (its messages'
    text deltas, its calls' opening and argument deltas), ``SAID_SLICE`` at a time with a turn of
    the loop between: not from the events that repeat a message whole (its ``.done`` events
    and the terminal one), which with log probabilities are megabytes, whose parse would
    hold the loop."""
    texts: list[str] = []
    calls: dict[str, dict[str, Any]] = {}  # by item id, in order
    for index, entry in enumerate(entries):
        if index and not index % SAID_SLICE:
            await asyncio.sleep(0)  # the other streams' turn
        event = entry.event
        if event in ("response.output_text.delta", "response.refusal.delta"):
            texts.append(json.loads(entry.data)["delta"])
        elif event == "response.output_item.added":
            item = json.loads(entry.data)["item"]
            if item["type"] == "function_call":
                calls[item["id"]] = item
        elif event == "response.function_call_arguments.delta":
            piece = json.loads(entry.data)
            call = calls.get(piece["item_id"])
            if call is not None:
                call["arguments"] += piece["delta"]
    made = [Call(call["call_id"], call["name"], call["arguments"]) for call in calls.values()]
    return Said("".join(texts), made)


async def items_in_events(entries: Sequence[LogEntry]) -> list[dict[str, Any]]:
    """An ended response's output items, read from its whole log's small events (each item's
    opening and its text, thinking or argument deltas), ``SAID_SLICE`` at a time with a turn
    of the loop between, as ``said_in_events`` reads them: not from the events that repeat an
    item whole. Without their statuses, which only those events give: what a next request
    takes back as its input."""
    items: dict[str, dict[str, Any]] = {}  # by item id, in order
    for index, entry in enumerate(entries):
        if index and not index % SAID_SLICE:
            await asyncio.sleep(0)  # the other streams' turn
        if entry.event in ITEM_EVENTS and entry.event != "response.output_item.done":
            _follow_item(items, entry.event, json.loads(entry.data))
    for item in items.values():
        del item["status"]
    return list(items.values())


def opened_object(first: LogEntry) -> dict[str, Any] | None:
    """The response object a response's first logged event carried, if that event is its
    ``response.created`` (None: trimmed, or another event)."""
    if first.event != "response.created":
        return None
    opened: dict[str, Any] = json.loads(first.data)["response"]
    return opened


# Codes of a reader's ending that say the response itself failed: its producer is gone, and
# nobody will write its end. Every other ending a reader decides (a slow client, this server
# shutting down, a store it cannot reach, events lost, a place past the end, a delete) ends
# its stream, not the response, which goes on (a client may resume it) or ends as its
# producer ends it, in its log.
RESPONSE_FAILED_CODES = frozenset({"generator_lost"})


DIALECT = "responses"  # a response's ``ReplyInfo.dialect``


class ReaderNotices:
    """How a Responses stream spells what its reader decides: OpenAI's ``error`` event; when
    the response itself failed with it (``RESPONSE_FAILED_CODES``: its producer is gone),
    then ``response.failed``. They are not in the log and have no ``id:``; each carries the
    ``sequence_number`` of the last event written before them (0 when there was none), so a
    client that resumes after the last number it saw (``starting_after``) gets the
    response's next event, which a number of their own would have skipped.
    The failed object is the response as it opened (its settings, as ``response.created``
    carried them), with the output items this stream has told its client (the open one
    cut: ``incomplete``), so a client that puts the response together from the events has
    what the failure says. A reader that resumed starts from the entries before its place
    (``told``)."""

    __slots__ = ("_opened", "_reply_id", "_told")
    tells_gaps = False  # an ``events_lost`` error ends the stream instead

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
        number = max(after - 1, 0)  # the log's number, as a sequence number
        error = json.loads(data)["error"]
        code, message = error["code"], error["message"]
        error_event = {"type": "error", "sequence_number": number, "code": code}
        error_event |= {"message": message, "param": error.get("param")}
        if code not in RESPONSE_FAILED_CODES:
            return [("error", compact_json(error_event))]
        opened = self._opened or {"id": response_id(self._reply_id), "object": "response"}
        failed = {
            **opened,
            "status": "failed",
            "error": response_error(code, message),
            "incomplete_details": None,
            "output": output_from_log(self._told, cut=True),
            "usage": None,
        }
        failed_event = {"type": "response.failed", "sequence_number": number, "response": failed}
        return [
            ("error", compact_json(error_event)),
            ("response.failed", compact_json(failed_event)),
        ]
