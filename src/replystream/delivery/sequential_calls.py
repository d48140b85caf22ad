"""Tool calls one after another, for the dialects whose content is one block at a time.

OpenAI's chat chunks number each tool call's pieces (``ToolCallDelta.index``), so a server
may send a later call's pieces between an earlier call's: call 0 named, call 1 named, more of
call 0's arguments, more of call 1's. An Anthropic message's content blocks and a Responses
output's items are strictly sequential: one is started, gets its deltas, is stopped, then the
next. ``SequentialCalls`` puts a reply's pieces in an order those dialects can send:
- A piece of the call open now is placed at once.
- Another piece may be placed (a new call, text or thinking, which stops the open call's
  block) when no call is open, or when the open call's arguments so far are one complete
  JSON value (``JsonCompleteness``, followed fragment by fragment). A sequential stream,
  what OpenAI, vLLM and our own engines send (each call's arguments complete before the next
  call starts), is placed as it comes: nothing waits.
- While the open call's arguments are incomplete every other piece is held, in the order it
  came; when they complete, the held pieces go through the same rule, in order.
- At the reply's end (``flush``: before any ending that closes blocks) whatever is held is
  placed, in order, each call open then taken for complete, so no piece is lost and none
  goes to a block already stopped.
A piece of a call whose block was stopped after its arguments were complete (so the piece
can only add whitespace, or text that is not JSON) has no block left to go to and is left
out. A call whose arguments are empty so far is incomplete: its first piece names it and its
arguments come after.
This file is pure state: it must not know about events, dialects or sockets. A format hands
it each piece with the function that makes that piece's events (``place``), which must stop
the open call's block for any piece that is not a call's.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from replystream.engine.base import TokenLogprob, ToolCallDelta

_SPACE = " \t\n\r"  # JSON's whitespace
_NOT_SPACE = re.compile(r"[^ \t\n\r]")
_IN_STRING = re.compile(r'["\\]')  # what ends a string, or escapes its next character
_STRUCTURE = re.compile(r'[][{}"]')  # outside strings: what opens or closes a value
_CLOSES = {"}": "{", "]": "["}

_EMPTY, _OPEN, _COMPLETE, _NEVER = range(4)


class JsonCompleteness:
    """Whether JSON text, fed a fragment at a time, is one complete value so far: an object,
    an array or a string that has closed, with only whitespace after it. Each fragment is
    read once (its brackets outside strings, string and escape state), never the text again.
    A value that is not an object, array or string at the top (a number, ``true``) is never
    taken for complete: a fragment may still add to it. Neither is text that cannot be JSON
    (a bracket closing the wrong one, a second value after the first)."""

    __slots__ = ("_escaped", "_in_string", "_open", "_state")

    def __init__(self) -> None:
        self._state = _EMPTY
        self._open: list[str] = []  # the brackets open now, outermost first
        self._in_string = False
        self._escaped = False  # the next character is escaped (a fragment ended with ``\``)

    def feed(self, fragment: str) -> bool:
        """Read the next fragment; return whether the text so far is one complete value."""
        state, end, at = self._state, len(fragment), 0
        while at < end:
            if state == _OPEN:
                if self._escaped:  # this character is escaped, whatever it is
                    self._escaped = False
                    at += 1
                elif self._in_string:
                    found = _IN_STRING.search(fragment, at)
                    if found is None:
                        break
                    at = found.end()
                    if found.group() == "\\":
                        self._escaped = True
                    else:
                        self._in_string = False
                        if not self._open:
                            state = _COMPLETE
                else:
                    found = _STRUCTURE.search(fragment, at)
                    if found is None:
                        break
                    at, mark = found.end(), found.group()
                    if mark == '"':
                        self._in_string = True
                    elif mark in "{[":
                        self._open.append(mark)
                    elif self._open.pop() != _CLOSES[mark]:
                        state = _NEVER
                    elif not self._open:
                        state = _COMPLETE
            elif state == _EMPTY:
                found = _NOT_SPACE.search(fragment, at)
                if found is None:
                    break
                at, mark = found.end(), found.group()
                if mark in "{[":
                    self._open.append(mark)
                    state = _OPEN
                elif mark == '"':
                    self._in_string = True
                    state = _OPEN
                else:
                    state = _NEVER
            elif state == _COMPLETE:
                if fragment[at:].strip(_SPACE):
                    state = _NEVER
                break
            else:  # _NEVER stays so
                break
        self._state = state
        return state == _COMPLETE


class TextPiece(NamedTuple):
    """A piece of the reply's text, held while a call's arguments are incomplete."""

    text: str
    tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # when the request asked for them


class ThinkingPiece(NamedTuple):
    """A piece of a reasoning model's thinking, held while a call's arguments are incomplete."""

    text: str
    tokens: int


Piece = ToolCallDelta | TextPiece | ThinkingPiece
E = TypeVar("E")  # an event, as the format that places the pieces makes it


class SequentialCalls:
    """A reply's pieces in an order where each call's pieces come together (see above)."""

    __slots__ = ("_arguments", "_held", "_open", "_started", "calling", "waiting")

    def __init__(self) -> None:
        self.calling = False  # a call's block is open now: text or thinking must come here
        self.waiting = False  # and its arguments are incomplete: other pieces are held
        self._open: int | None = None  # the index of that call
        self._arguments = JsonCompleteness()  # of that call's arguments
        self._started: set[int] = set()  # the indexes of every call placed
        self._held: deque[Piece] = deque()  # pieces held, in the order they came

    def take(self, piece: Piece, place: Callable[[Piece], list[E]]) -> list[E]:
        """The events of ``piece``, and of the held pieces it lets go, in order (none while
        it is held)."""
        return self._place(deque((piece,)), place)

    def flush(self, place: Callable[[Piece], list[E]]) -> list[E]:
        """The events of every piece held, in order: the reply ends, so the call open now
        (and each one the held pieces open) is taken for complete."""
        events: list[E] = []
        while self._held:
            self.waiting = False
            pending, self._held = self._held, deque()
            events += self._place(pending, place)
        return events

    def _place(self, pending: deque[Piece], place: Callable[[Piece], list[E]]) -> list[E]:
        events: list[E] = []
        while pending:
            piece = pending.popleft()
            if not isinstance(piece, ToolCallDelta):
                if self.waiting:
                    self._held.append(piece)
                    continue
                self._open, self.calling = None, False  # its block stops the call's
            elif piece.index == self._open:
                complete = self._arguments.feed(piece.arguments)
                if self.waiting and complete and self._held:
                    # What waited came before anything still pending: it goes first.
                    pending.extendleft(reversed(self._held))
                    self._held.clear()
                self.waiting = not complete
            elif self.waiting:
                self._held.append(piece)
                continue
            elif piece.index in self._started:
                continue  # its block is stopped, its arguments were complete: see above
            else:
                self._started.add(piece.index)
                self._open, self.calling = piece.index, True
                self._arguments = JsonCompleteness()
                self.waiting = not self._arguments.feed(piece.arguments)
            events += place(piece)
        return events
