"""Tool calls put together from their streamed pieces, for whole replies and closing events.

A reply's tool calls arrive as ``ToolCallDelta`` pieces: the first of an index names the call
(id and name), the rest carry fragments of its JSON arguments. ``ToolCalls`` joins them per
index, in the order the indexes first appeared; the arguments are kept exactly as the
fragments spelt them (never re-encoded), since a client compares them byte for byte. Each call
remembers how much of the reply's text came before it (``text_at``), so the dialects whose
content is ordered blocks (Anthropic, Responses) put text and calls in the order they came
(``reply_content.in_order``).
This file is pure: it must not know about events, dialects or sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

from replystream.engine.base import ToolCallDelta


class Fragments:
    """Text that grows by fragments (a call's arguments, a stretch of thinking), joined when
    read. Each fragment appended to one string copied all the text before it: a call's
    arguments and a stretch of thinking of 160,000 fragments each (a file of 640 KB that a
    tool writes) took 3.0 s of the event loop, 19 times what 40,000 took."""

    __slots__ = ("_parts",)

    def __init__(self, text: str = "") -> None:
        self._parts = [text] if text else []

    def add(self, fragment: str) -> None:
        self._parts.append(fragment)

    def text(self) -> str:
        """All the fragments so far, joined (once: a later read costs nothing more)."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""


class ToolCall:
    """One whole tool call: its id, the function's name, and its arguments (JSON text)."""

    __slots__ = ("_arguments", "id", "index", "name", "text_at")

    def __init__(
        self, index: int, id: str, name: str, arguments: str = "", text_at: int = 0
    ) -> None:
        self.index = index
        self.id = id
        self.name = name
        self._arguments = Fragments(arguments)
        self.text_at = text_at  # characters of the reply's text made before the call began

    @property
    def arguments(self) -> str:
        return self._arguments.text()

    def add_arguments(self, fragment: str) -> None:
        self._arguments.add(fragment)

    def _fields(self) -> tuple[int, str, str, str, int]:
        return self.index, self.id, self.name, self.arguments, self.text_at

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolCall):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        index, id_, name, arguments, text_at = self._fields()
        return f"ToolCall({index!r}, {id_!r}, {name!r}, {arguments!r}, text_at={text_at!r})"

    def parsed_arguments(self) -> Any:
        """The arguments as a JSON value (an empty string is ``{}``, as a call without
        arguments sends; JSON cut short, by a token limit, is what it holds so far; text
        that is not JSON, or that nests too deep to be written again, is kept as a string,
        not dropped)."""
        if not self.arguments.strip():
            return {}
        try:
            # As the anthropic SDK reads a stream's fragments (jiter, incomplete values
            # dropped), so a whole message equals the one it assembles from the same call.
            # Its nesting bound is a ValueError, where json.loads recurses to the interpreter's
            # limit (a RecursionError), and a value near that limit could not be encoded again.
            return from_json(self.arguments, allow_partial=True)
        except ValueError:
            return self.arguments

    def as_openai(self) -> dict[str, Any]:
        """The call in a chat message's ``tool_calls`` (OpenAI's shape)."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def ending_of(made_calls: bool, finish: str, stop: str | None) -> tuple[str, str | None]:
    """A reply's finish reason and stop string, given whether it made tool calls.

    A reply that made calls ends as one that did (as vLLM ends it), whatever cut its text
    after them: an agent runs the calls on that finish alone, so the stop string goes too.
    """
    if made_calls and finish == "stop":
        return "tool_calls", None
    return finish, stop


@dataclass(slots=True)
class ToolCalls:
    """The tool calls of one reply so far, joined from their pieces."""

    calls: dict[int, ToolCall] = field(default_factory=dict)

    def add(self, piece: ToolCallDelta, text_at: int = 0) -> ToolCall:
        """Take one piece; return the call it belongs to (new on its index's first piece,
        after ``text_at`` characters of the reply's text)."""
        call = self.calls.get(piece.index)
        if call is None:
            call = ToolCall(piece.index, piece.id or "", piece.name or "", text_at=text_at)
            self.calls[piece.index] = call
        else:
            # Some servers repeat the id or name on later pieces: the first one stands.
            call.id = call.id or piece.id or ""
            call.name = call.name or piece.name or ""
        call.add_arguments(piece.arguments)
        return call

    def whole(self) -> tuple[ToolCall, ...]:
        return tuple(self.calls.values())
