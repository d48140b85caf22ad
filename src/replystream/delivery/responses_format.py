"""The OpenAI Responses dialect: typed events of one response, and its whole-response object.

This file decides what a Responses client (``client.responses`` of the openai SDK, agent
frameworks) reads, byte for byte:
- A streamed response is ``event: <type>`` with a ``data:`` object whose ``type`` matches and
  whose ``sequence_number`` counts the response's events from 0, as OpenAI's do (the cursor
  of ``starting_after``; the event's SSE ``id:``, the cursor of ``Last-Event-ID``, is its
  number in the reply log, one more), in OpenAI's order: ``response.created``,
  ``response.in_progress``, then the output items in order (a message:
  ``response.output_item.added``, ``response.content_part.added``, one
  ``response.output_text.delta`` per piece of text, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``), then the terminal event:
  ``response.completed`` (with usage), ``response.incomplete`` (with usage; the token limit,
  or a check or a relayed upstream's own filter that stopped the text: ``content_filter``) or
  ``response.failed`` (with the error). There is no ``[DONE]``: the terminal event ends the stream.
- A background response is ``queued`` until the engine takes it up, as OpenAI's is: its
  ``response.created`` carries ``status: "queued"`` and is followed by ``response.queued``
  (the same object), and its ``response.in_progress`` comes only when the engine admits the
  request (``admitted``: at once for an engine with no queue of its own), so its log tells a
  reader polling it which of the two it is. Should an engine make output without saying so,
  ``response.in_progress`` goes before the first output item or the ending (never before a
  ``response.failed``: a response cancelled while queued never started). A response that is
  not in the background is never queued, as OpenAI's is not: ``response.created``
  (``in_progress``) and ``response.in_progress`` open it at once, whatever the engine's queue.
- A message item is opened when text comes (a response of calls only has none), and closed
  when a call starts or the response ends; text after a call opens a new message item
  (``msg_<reply id>`` first in the output, ``msg_<reply id>_<output index>`` after a call).
- A tool call is a ``function_call`` output item: the open item is closed (its ``.done``
  events), then ``response.output_item.added`` (``type: "function_call"``, ``call_id``,
  ``name``, ``arguments: ""``), one ``response.function_call_arguments.delta`` per fragment,
  and when the next item starts or the response ends
  ``response.function_call_arguments.done`` (the call's ``name`` and whole arguments) and
  ``response.output_item.done``. The whole response's ``output`` has the same items in the
  same order. Items never interleave: calls whose fragments an upstream interleaved (chat's
  indexes allow it) are one item after another, what came while a call's arguments were
  incomplete waiting until they are (``sequential_calls``).
- A reasoning model's thinking, relayed, is a ``reasoning`` output item (``rs_<reply id>_<output
  index>``), as vLLM and the open-weight models' servers stream it: ``response.output_item.
  added``, ``response.content_part.added`` (a ``reasoning_text`` part), one
  ``response.reasoning_text.delta`` per piece, then ``response.reasoning_text.done``,
  ``response.content_part.done`` and ``response.output_item.done`` when text or a call
  comes. Its ``summary`` is empty and it has no ``encrypted_content``: the thinking is given
  as it came. The usage counts its tokens in ``output_tokens_details.reasoning_tokens``.
- A model's refusal to answer (a relayed upstream's: ``Delta.refusal``) is a message item
  whose part is a ``refusal`` part, as OpenAI streams one: ``response.content_part.added``
  (``{"type": "refusal", "refusal": ""}``), one ``response.refusal.delta`` per piece, then
  ``response.refusal.done`` (the whole words) before ``response.content_part.done``. It has
  no log probabilities, included or not.
- Log probabilities, when the request included them (``message.output_text.logprobs``),
  are OpenAI's: each ``response.output_text.delta`` lists exactly its own tokens' (``token``,
  ``logprob``, ``top_logprobs``: the likeliest tokens, best first), the message's
  ``response.output_text.done`` all of its text's, and its ``output_text`` part (in
  ``response.content_part.done``, ``response.output_item.done`` and the response object) the
  same with each token's ``bytes``. Not included, every one of those lists is empty.
- The same response whole, not streamed, is the object the terminal event carries
  (``responses_objects``); what its log tells of a response, and what a reader that ends
  the stream alone says, is ``responses_log``'s.
A format object serves one response: it numbers its events as the pipeline will (one per
spec, each one below its number in the log), and keeps the text so far, which the closing
events repeat. It must not know about sockets, tasks or stores.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from replystream.delivery.formats import Spec, Usage, json_string, moderated_payload
from replystream.delivery.moderation import Violation
from replystream.delivery.openai_formats import logprob_entries
from replystream.delivery.reply_content import Thought, Thoughts
from replystream.delivery.responses_objects import (
    INCOMPLETE_REASONS,
    ItemStatus,
    ResponseSettings,
    Status,
    compact_json,
    function_call_item,
    message_id,
    message_item,
    output_text_part,
    reasoning_item,
    refusal_part,
    response_error,
    response_object,
)
from replystream.delivery.sequential_calls import (
    Piece,
    SequentialCalls,
    TextPiece,
    ThinkingPiece,
)
from replystream.delivery.sliced_json import Written
from replystream.delivery.tool_calls import ToolCall, ToolCalls
from replystream.engine.base import TokenLogprob, ToolCallDelta


@dataclass(slots=True)
class ResponsesStreamFormat:
    """The typed events of one streamed response (a ``StreamFormat``)."""

    settings: ResponseSettings
    _reply_id: str = ""
    _next: int = 0  # the next spec's sequence number (its number in the log, less one)
    _text: list[str] = field(default_factory=list)
    _text_counted: tuple[int, int] = (0, 0)  # (pieces of ``_text`` counted, their characters)
    _delta_head: str = ""  # a text delta's JSON up to its number, for the open message
    _refused: bool = False  # the text is a refusal (``refusing``): its messages say so
    _calls: ToolCalls = field(default_factory=ToolCalls)
    _items: int = 0  # output items started so far
    _open_call: ToolCall | None = None  # the function call item open now, if any
    _open_message: int | None = None  # the output index of the message open now, if any
    _message_from: int = 0  # where the open message's text starts in ``_text``
    _call_index: dict[int, int] = field(default_factory=dict)  # call index -> output index
    _thoughts: Thoughts = field(default_factory=Thoughts)
    _open_thought: tuple[int, Thought] | None = None  # the reasoning item open now, if any
    # The log probabilities of each message item's text so far (the open one's last), when
    # the request included them: written as each delta comes, without ``bytes`` (for its
    # ``output_text.done``) and with them (its part, its item, the response). The last events
    # repeat them all; made and written then, in one go, they would hold the loop.
    _logprobs: list[tuple[Written, Written]] = field(default_factory=list)
    _in_progress: bool = False  # ``response.in_progress`` is written
    _sequence: SequentialCalls | None = None  # one call at a time (None: no call yet)

    def _event(self, kind: str, payload: dict[str, Any]) -> Spec:
        number = self._next
        self._next += 1
        return kind, compact_json({"type": kind, "sequence_number": number, **payload})

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
            logprobs=[entries or () for _, entries in self._logprobs],
            refusal=self._refused,
            **details,
        )

    def started(self, reply_id: str) -> list[Spec]:
        self._reply_id = reply_id
        if self.settings.background:  # queued until the engine takes it up (``admitted``)
            queued = response_object(self.settings, reply_id, "queued")
            return [
                self._event("response.created", {"response": queued}),
                self._event("response.queued", {"response": queued}),
            ]
        empty = response_object(self.settings, reply_id, "in_progress")
        return [self._event("response.created", {"response": empty}), *self._opened()]

    def admitted(self) -> list[Spec]:
        return self._opened()

    def _opened(self) -> list[Spec]:
        """``response.in_progress``, unless it is written already."""
        if self._in_progress:
            return []
        self._in_progress = True
        empty = response_object(self.settings, self._reply_id, "in_progress")
        return [self._event("response.in_progress", {"response": empty})]

    def prompt_counted(self, tokens: int, cached: int | None) -> None:
        pass  # usage is null until the terminal event, which tells it

    def text(self, text: str, tokens: int) -> list[Spec]:
        if self._open_message is not None:
            self._text.append(text)
            number = self._next
            self._next += 1
            # Spelt out: one per piece of text, the event every response sends most.
            if self._refused:  # (a refusal's delta has no log probabilities)
                delta = (self._delta_head % number) + json_string(text) + "}"
                return [("response.refusal.delta", delta)]
            delta = (self._delta_head % number) + json_string(text) + ',"logprobs":[]}'
            return [("response.output_text.delta", delta)]
        if not text:
            return []  # no message is opened for no text
        calls = self._sequence
        if calls is not None and calls.calling:  # after a call's arguments, perhaps incomplete
            return calls.take(TextPiece(text, tokens), self._place)
        specs = self._open_item_message()
        return specs + self.text(text, tokens)

    def _open_item_message(self) -> list[Spec]:
        """Close the open call, if any, and open a message item."""
        specs = self._opened() + self._close_open("completed")
        output_index = self._open_message = self._items
        self._items += 1
        self._message_from = len(self._text)
        self._logprobs.append((Written(), Written()))
        item_id = message_id(self._reply_id, output_index)
        kind = "response.refusal.delta" if self._refused else "response.output_text.delta"
        self._delta_head = (
            f'{{"type":"{kind}","sequence_number":%d,'
            f'"item_id":"{item_id}","output_index":{output_index},"content_index":0,"delta":'
        )
        item = {
            "type": "message",
            "id": item_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = refusal_part("") if self._refused else output_text_part("")
        where = {"item_id": item_id, "output_index": output_index, "content_index": 0}
        return [
            *specs,
            self._event("response.output_item.added", {"output_index": output_index, "item": item}),
            self._event("response.content_part.added", {**where, "part": part}),
        ]

    def text_logprobs(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]
    ) -> list[Spec]:
        if self._refused:
            return self.text(text, tokens)  # a refusal part has no log probabilities
        specs: list[Spec] = []
        if self._open_message is None:
            if not text:  # text-less tokens with no message to hold them: nothing to show
                return []
            calls = self._sequence
            if calls is not None and calls.calling:  # after a call's arguments, perhaps incomplete
                return calls.take(TextPiece(text, tokens, logprobs), self._place)
            specs = self._open_item_message()
        self._text.append(text)
        plain, full = self._logprobs[-1]
        full.add(compact_json(logprob_entries(logprobs)))
        number = self._next
        self._next += 1
        entries = compact_json(logprob_entries(logprobs, with_bytes=False))
        plain.add(entries)
        delta = f'{self._delta_head % number}{json_string(text)},"logprobs":{entries}}}'
        specs.append(("response.output_text.delta", delta))
        return specs

    def tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        if self._sequence is None:  # made at the first call: a reply of text never needs it
            self._sequence = SequentialCalls()
        return self._sequence.take(piece, self._place)

    def _place(self, piece: Piece) -> list[Spec]:
        """The events of a piece ``SequentialCalls`` lets go now."""
        if isinstance(piece, ToolCallDelta):
            return self._tool_call(piece)
        if isinstance(piece, ThinkingPiece):
            return self._reasoning(piece.text)
        if piece.logprobs is None:
            return self.text(piece.text, piece.tokens)
        return self.text_logprobs(piece.text, piece.tokens, piece.logprobs)

    def _tool_call(self, piece: ToolCallDelta) -> list[Spec]:
        call = self._calls.calls.get(piece.index)
        specs: list[Spec] = []
        if call is None:  # a new call: close the item open now, then add a function_call item
            specs = self._opened() + self._close_open("completed")
            call = self._calls.add(piece, self._text_chars())
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
        calls = self._sequence
        if calls is not None and calls.calling:  # after a call's arguments, perhaps incomplete
            return calls.take(ThinkingPiece(thought, tokens), self._place)
        return self._reasoning(thought)

    def _reasoning(self, thought: str) -> list[Spec]:
        specs: list[Spec] = []
        if self._open_thought is None:  # close the item open now, then add a reasoning item
            specs = self._opened() + self._close_open("completed")
        text_at = self._text_chars()
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

    def _text_chars(self) -> int:
        """The characters of text so far, each piece counted once. Summed whole at each
        piece of thinking, the text before a long thought cost each of its pieces all of
        that text; counted here rather than as each piece of text comes, the text's own
        path (every token's) does no more than before."""
        counted, chars = self._text_counted
        if counted < len(self._text):
            chars += sum(map(len, itertools.islice(self._text, counted, None)))
            self._text_counted = len(self._text), chars
        return chars

    def _held(self) -> list[Spec]:
        """The events of every piece still held for a call's arguments: the response ends."""
        return [] if self._sequence is None else self._sequence.flush(self._place)

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
            # The call's name too, as OpenAI's event carries it: a client that reads only
            # the ``.done`` events has every call whole.
            arguments = {**where, "name": call.name, "arguments": call.arguments}
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
        plain, full = self._logprobs[-1]
        # (None written, as without log probabilities: a plain ``[]``, the events' quick way.)
        item = message_item(
            self._reply_id, message, text, status, full or (), refusal=self._refused
        )
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": message, "content_index": 0}
        logprobs: Written | list[Any] = plain or []
        done = (
            self._event("response.refusal.done", {**where, "refusal": text})
            if self._refused
            else self._event(
                "response.output_text.done", {**where, "text": text, "logprobs": logprobs}
            )
        )
        return [
            done,
            self._event("response.content_part.done", {**where, "part": part}),
            self._event("response.output_item.done", {"output_index": message, "item": item}),
        ]

    def finished(
        self, finish_reason: str, usage: Usage, stop_sequence: str | None = None
    ) -> list[Spec]:
        incomplete = INCOMPLETE_REASONS.get(finish_reason)
        opened = self._opened()  # (a response that finished was taken up)
        opened += self._held()
        if incomplete is not None:
            details = {"usage": usage, "incomplete_reason": incomplete}
            return [
                *opened,
                *self._close_open("incomplete"),
                self._event(
                    "response.incomplete", {"response": self._response("incomplete", **details)}
                ),
            ]
        return [
            *opened,
            *self._close_open("completed"),
            self._event(
                "response.completed", {"response": self._response("completed", usage=usage)}
            ),
        ]

    def error(self, message: str, code: str, status: int | None = None) -> list[Spec]:
        # Its ``error.code`` is by our code (``response_error``), as a whole failed
        # response's is: the same either way. Its output has every piece made, the held
        # ones too (their events go first).
        specs = self._held()
        # A cancelled response is not an error: OpenAI's object has ``error: null``.
        if code == "cancelled":
            response = self._response("cancelled", error=None)
        else:
            response = self._response("failed", error=response_error(code, message))
        return [*specs, self._event("response.failed", {"response": response})]

    def continued(self, reason: str, tokens: int) -> list[Spec]:
        return []  # no such event in this dialect: the text simply goes on

    def refusing(self) -> list[Spec]:
        self._refused = True  # before any text: the messages it opens hold a refusal part
        return []

    def moderated(self, violation: Violation, usage: Usage) -> list[Spec]:
        specs = self._opened() + self._held()
        response = self._response("incomplete", usage=usage, incomplete_reason="content_filter")
        response["replystream_moderation"] = moderated_payload(violation)
        return [
            *specs,
            *self._close_open("incomplete"),
            self._event("response.incomplete", {"response": response}),
        ]
