"""A reply's content in the order it was made: its text, its tool calls, and a reasoning
model's thinking, for the dialects whose content is ordered blocks (Anthropic's message, a
Responses output).

Thinking arrives as pieces (``Delta.reasoning``). ``Thoughts`` joins the pieces that came one
after another into one stretch, and starts a new stretch after text or a call came between
(a relay's continuation can think again mid-reply). Each stretch, like each ``ToolCall``,
remembers where it began: after how much of the reply's text, and after how many calls.
This file is pure: it must not know about events, dialects or sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from replystream.delivery.tool_calls import Fragments, ToolCall


class Thought:
    """One stretch of thinking, and where in the reply it began."""

    __slots__ = ("_text", "calls_before", "text_at")

    def __init__(self, text: str, text_at: int = 0, calls_before: int = 0) -> None:
        self._text = Fragments(text)  # a reasoning model's thinking comes in thousands
        self.text_at = text_at  # characters of the reply's text made before it began
        self.calls_before = calls_before  # tool calls begun before it

    @property
    def text(self) -> str:
        return self._text.text()

    def add(self, piece: str) -> None:
        self._text.add(piece)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Thought):
            return NotImplemented
        mine = (self.text, self.text_at, self.calls_before)
        return mine == (other.text, other.text_at, other.calls_before)

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        return f"Thought({self.text!r}, {self.text_at!r}, {self.calls_before!r})"


@dataclass(slots=True)
class Thoughts:
    """The thinking of one reply so far, in stretches."""

    stretches: list[Thought] = field(default_factory=list)
    _open: bool = False  # the last stretch takes the next piece

    def add(self, piece: str, text_at: int, calls_before: int) -> tuple[Thought, bool]:
        """Take one piece; return its stretch, and whether the piece began it."""
        if self._open:
            last = self.stretches[-1]
            last.add(piece)
            return last, False
        stretch = Thought(piece, text_at, calls_before)
        self.stretches.append(stretch)
        self._open = True
        return stretch, True

    def interrupt(self) -> None:
        """Text or a call came: the next piece of thinking begins a new stretch."""
        self._open = False

    def whole(self) -> tuple[Thought, ...]:
        return tuple(self.stretches)


def in_order(
    text: str, calls: Sequence[ToolCall], thoughts: Sequence[Thought] = ()
) -> list[str | ToolCall | Thought]:
    """A reply's content in the order it was made: its text cut where each call or stretch
    of thinking began, those between the pieces (at one place in the text, a stretch before
    the call it came before), no empty piece of text."""
    # Both positions only grow as a reply is made, so (text position, calls so far) orders
    # every call and stretch as they came: call i sorts after the stretches with i calls
    # before them.
    marks: list[tuple[int, int, ToolCall | Thought]] = [
        (call.text_at, 2 * number + 1, call) for number, call in enumerate(calls)
    ]
    marks += [(thought.text_at, 2 * thought.calls_before, thought) for thought in thoughts]
    marks.sort(key=lambda mark: (mark[0], mark[1]))
    content: list[str | ToolCall | Thought] = []
    at = 0
    for text_at, _, piece in marks:
        text_at = min(text_at, len(text))  # text after a stop string is cut from the reply
        if text_at > at:
            content.append(text[at:text_at])
            at = text_at
        content.append(piece)
    if at < len(text):
        content.append(text[at:])
    return content
