"""A character cut between two chunks of an upstream's stream: its UTF-16 halves joined.

Node.js's ``JSON.stringify`` writes a lone surrogate escape for each half of a character its
server cut between two chunks, which pydantic's parser refuses. Such an event is read by
``json`` instead (``with_lone_surrogates``), and its pieces (text, thinking, each tool call's
arguments) are mended across chunks (``mend``): a high surrogate at a piece's end is held and
joined to the low one at the start of the next piece of the same kind, into the one
character; a half left alone becomes U+FFFD, as a UTF-8 decoder's bad bytes do. It must not
know where the chunks come from or what else they mean (``upstream_chunks``).
"""

from __future__ import annotations

import json
import re
from collections import deque

from replystream.engine.base import Delta, ToolCallDelta

# A JSON escape of a UTF-16 surrogate (``\\ud83d``): pydantic's parser refuses an event with one
# that is alone, which is the only kind sent to ``with_lone_surrogates`` (a pair is parsed).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogates_replaced(text: str, *, keep_ends: bool = False) -> str:
    """``text`` with each surrogate not in a pair as U+FFFD; with ``keep_ends``, but for a
    low surrogate that begins it and a high one that ends it (a character's halves that
    the chunks before and after it hold the others of)."""
    if _SURROGATE.search(text) is None:
        return text
    head = tail = ""
    if keep_ends:
        if "\udc00" <= text[0] <= "\udfff":
            head, text = text[0], text[1:]
        if text and "\ud800" <= text[-1] <= "\udbff":
            tail, text = text[-1], text[:-1]
    # Through UTF-16: a pair is its character, a lone half the decoder's U+FFFD.
    middle = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return head + middle + tail


def _mended(value: object) -> object:
    """A value ``json`` parsed with every lone surrogate in its strings as U+FFFD."""
    if type(value) is str:
        return _lone_surrogates_replaced(value)
    if type(value) is list:
        return [_mended(item) for item in value]
    if type(value) is dict:
        return {_lone_surrogates_replaced(k): _mended(v) for k, v in value.items()}
    return value


def _joined(high: str, text: str) -> str:
    """A high surrogate held from one piece before the next piece's ``text``: the character
    the pair makes when ``text`` begins with the low one, else U+FFFD (and ``text``'s own low
    surrogate at its start, if alone, U+FFFD too)."""
    if "\udc00" <= text[0] <= "\udfff":
        pair = (high + text[0]).encode("utf-16-le", "surrogatepass").decode("utf-16-le")
        return pair + text[1:]
    return "\ufffd" + text


# The kinds of piece a character's halves may be cut between (``ChunkReader._mend``): text,
# thinking, and each tool call's arguments (by the call's index, an int).
_TEXT, _THINKING = "text", "thinking"


def _piece_of(delta: Delta) -> tuple[str | int, str] | None:
    """The kind of piece ``delta`` is, and its piece (None: it has none)."""
    if delta.text:
        return _TEXT, delta.text
    if delta.reasoning:
        return _THINKING, delta.reasoning
    call = delta.tool_call
    if call is not None and call.arguments:
        return call.index, call.arguments
    return None


def _held_half(delta: Delta) -> str:
    """The high surrogate a held delta (``ChunkReader._held``) holds: its piece."""
    found = _piece_of(delta)
    assert found is not None
    return found[1]


def _with_piece(delta: Delta, kind: str | int, piece: str) -> Delta:
    """``delta`` with its piece of ``kind`` (``_piece_of``) replaced by ``piece``."""
    if kind == _TEXT:
        return delta._replace(text=piece)
    if kind == _THINKING:
        return delta._replace(reasoning=piece)
    assert delta.tool_call is not None
    return delta._replace(tool_call=delta.tool_call._replace(arguments=piece))


def _half_alone(kind: str | int, half: str, made_at: float) -> Delta:
    """A piece of ``kind`` that is only ``half``, a character's high surrogate, carrying no
    token of its own."""
    if kind == _TEXT:
        return Delta(half, 0, made_at)
    if kind == _THINKING:
        return Delta("", 0, made_at, reasoning=half)
    assert isinstance(kind, int)
    return Delta("", 0, made_at, tool_call=ToolCallDelta(kind, None, None, half))


def with_lone_surrogates(data: str, piece_keys: tuple[str, ...]) -> object:
    """An event pydantic's parser refused, with a surrogate escape in it, as ``json``
    reads it: each string's lone surrogates U+FFFD, but for those at the ends of a
    choice's text, thinking (a delta's ``piece_keys``) or tool call arguments, which
    ``mend`` joins to their pieces' neighbours.

    Raises:
        ValueError: the event is not JSON (or nests past Python's limit).
    """
    try:
        # Recursive, as ``_mended`` is: a nesting past Python's limit is no chunk.
        chunk = json.loads(data)
        mended = _mended(chunk)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if type(chunk) is dict and type(mended) is dict and type(chunk.get("choices")) is list:
        for raw, choice in zip(chunk["choices"], mended["choices"], strict=True):
            if type(raw) is not dict:
                continue
            delta = raw.get("delta")
            if type(delta) is dict:
                mended_delta = choice["delta"]
                for key in piece_keys:
                    if type(delta.get(key)) is str:
                        mended_delta[key] = _lone_surrogates_replaced(delta[key], keep_ends=True)
                calls = delta.get("tool_calls")
                if type(calls) is list:
                    for call, mended_call in zip(calls, mended_delta["tool_calls"], strict=True):
                        function = call.get("function") if type(call) is dict else None
                        if type(function) is dict and type(function.get("arguments")) is str:
                            mended_call["function"]["arguments"] = _lone_surrogates_replaced(
                                function["arguments"], keep_ends=True
                            )
            elif delta is None and type(raw.get("text")) is str:
                choice["text"] = _lone_surrogates_replaced(raw["text"], keep_ends=True)
    return mended


def mend(pending: deque[Delta], start: int, holds: dict[str | int, Delta]) -> bool:
    """The deltas of ``pending`` from ``start`` on, made of pieces (text, thinking, a tool
    call's arguments: ``_piece_of``) with a surrogate left at an end
    (``with_lone_surrogates``) or after one held in ``holds`` (by kind): each joined to
    the one its kind held before it, and one ending in a high surrogate held in turn.
    Thinking's held half goes out alone (U+FFFD) when the answer begins, text or a call:
    the thinking is over. Whether a half was held anew (the chunk's bytes are then no
    template: its text is not the chunk's)."""
    held_anew = False
    made = [pending.pop() for _ in range(len(pending) - start)]
    for delta in reversed(made):
        if _THINKING in holds and (delta.text or delta.tool_call is not None):
            pending.append(_with_piece(holds.pop(_THINKING), _THINKING, "\ufffd"))
        found = _piece_of(delta)
        if found is None:
            pending.append(delta)
            continue
        kind, piece = found
        held = holds.pop(kind, None)
        if held is not None:
            piece = _joined(_held_half(held), piece)
            logprobs = delta.logprobs
            if held.logprobs and logprobs:
                logprobs = held.logprobs + logprobs
            delta = delta._replace(tokens=held.tokens + delta.tokens, logprobs=logprobs)
        elif "\udc00" <= piece[0] <= "\udfff":
            piece = "\ufffd" + piece[1:]
        if "\ud800" <= piece[-1] <= "\udbff":
            held_anew = True
            call = delta.tool_call
            if len(piece) == 1 and (call is None or (call.id is None and call.name is None)):
                holds[kind] = _with_piece(delta, kind, piece)
                continue
            # (A call's first piece goes out for its id and name, its arguments held.)
            holds[kind] = _half_alone(kind, piece[-1], delta.made_at)
            piece = piece[:-1]
        pending.append(_with_piece(delta, kind, piece))
    return held_anew


def half_held_alone(kind: str | int, held: Delta) -> Delta:
    """A held delta (``mend``'s ``holds``) sent as it is, its half U+FFFD: no piece of its
    kind came after it."""
    return _with_piece(held, kind, "\ufffd")
