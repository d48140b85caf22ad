"""One tool call at a time (``delivery.sequential_calls``): the completeness of arguments read
fragment by fragment, and the order the pieces of interleaved calls are let go in (pure
code; the dialects over a real server are ``test_interleaved_tool_calls``)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from replystream.delivery.sequential_calls import (
    JsonCompleteness,
    Piece,
    SequentialCalls,
    TextPiece,
    ThinkingPiece,
)
from replystream.engine.base import ToolCallDelta

COMPLETE = [
    "{}",
    "[]",
    '""',
    ' {"a": 1} \n',
    '{"text": "a } and a { and ] [ in a string"}',
    '{"quote": "she said \\"}\\" twice", "path": "C:\\\\"}',
    '{"nested": [[1, [2, {"b": [3, []]}]], {"c": {}}]}',
    '{"escaped": "\\u007d\\n\\\\\\""}',
    '"a string: {[\\"]}"',
]
# Each: not one complete JSON value however much of it is read.
NEVER_COMPLETE = ["", "  ", "12", "true", "null", "{]", "[}", "{}{}", "{} x", "x{}", '{"a": "}\'']


def fed(fragments: list[str]) -> list[bool]:
    tracker = JsonCompleteness()
    return [tracker.feed(fragment) for fragment in fragments]


def is_complete(text: str) -> bool:
    """The reference: one JSON object, array or string, and only whitespace around it."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return text.strip()[:1] in ("{", "[", '"')


@pytest.mark.parametrize("text", COMPLETE)
def test_arguments_are_complete_only_once_their_value_closes_wherever_they_are_split(text: str):
    assert is_complete(text)
    for cuts in itertools.combinations(range(1, len(text)), min(2, len(text) - 1)):
        fragments = [text[i:j] for i, j in itertools.pairwise((0, *cuts, len(text)))]
        seen = fed(fragments)
        so_far = list(itertools.accumulate(fragments))
        assert seen == [is_complete(prefix) for prefix in so_far], fragments
        assert seen[-1]


@pytest.mark.parametrize("text", COMPLETE + NEVER_COMPLETE)
def test_one_character_at_a_time_agrees_with_a_whole_parse(text: str):
    assert fed(list(text) or [""]) == [is_complete(text[: i + 1]) for i in range(len(text) or 1)]


def test_random_splits_of_random_documents_agree_with_a_whole_parse():
    rng = random.Random(7)
    alphabet = ['"', "\\", "{", "}", "[", "]", ",", ":", " ", "a", "1"]
    for _ in range(300):
        value = {"s": "".join(rng.choices(alphabet, k=12)), "l": [[rng.random()], {"k": "}"}]}
        text = json.dumps(value)
        cuts = sorted(rng.sample(range(1, len(text)), 5))
        fragments = [text[i:j] for i, j in itertools.pairwise((0, *cuts, len(text)))]
        expected = [is_complete(prefix) for prefix in itertools.accumulate(fragments)]
        assert fed(fragments) == expected, fragments


def call(index: int, arguments: str = "", name: str | None = None) -> ToolCallDelta:
    return ToolCallDelta(index, None if name is None else f"call_{index}", name, arguments)


def placed(pieces: list[Piece], end: bool = True) -> list[Piece]:
    """The pieces in the order ``SequentialCalls`` lets them go (``end``: the reply ends)."""
    calls = SequentialCalls()
    out: list[Piece] = []
    for piece in pieces:
        out += calls.take(piece, lambda p: [p])
    return out + calls.flush(lambda p: [p]) if end else out


def test_a_sequential_stream_goes_through_as_it_came_and_nothing_waits():
    pieces: list[Piece] = [
        TextPiece("Let me look. ", 1),
        call(0, name="get_weather"),
        call(0, '{"city": "Pa'),
        call(0, 'ris"}'),
        call(1, '{"tz":', name="get_time"),
        call(1, ' "CET"}'),
        TextPiece("Done.", 1),
    ]
    assert placed(pieces, end=False) == pieces


def test_interleaved_calls_are_let_go_one_after_the_other():
    a0, a1, a2 = call(0, '{"city": '), call(0, '"Paris", "note": "} ]"'), call(0, "}")
    b0, b1 = call(1, '{"tz": '), call(1, '"CET"}')
    pieces: list[Piece] = [call(0, name="f"), call(1, name="g"), a0, b0, a1, b1, a2]
    assert placed(pieces, end=False) == [call(0, name="f"), a0, a1, a2, call(1, name="g"), b0, b1]


def test_text_and_thinking_wait_for_the_open_calls_arguments_and_keep_their_order():
    thinking, text = ThinkingPiece("hmm", 1), TextPiece("so", 1)
    pieces: list[Piece] = [call(0, "{", name="f"), thinking, call(1, "[]", name="g"), text]
    head = placed([*pieces, call(0, "}")], end=False)
    assert head == [call(0, "{", name="f"), call(0, "}"), thinking, call(1, "[]", name="g"), text]


def test_a_held_call_that_opens_takes_its_own_held_fragments_before_text_held_after_it():
    # Held while call 0 was open: call 1's start, text, call 1's rest. When call 0 completes,
    # call 1 opens; its rest comes before the text, which waits for call 1 in turn.
    pieces: list[Piece] = [
        call(0, "{", name="f"),
        call(1, "[", name="g"),
        TextPiece("between", 1),
        call(1, "]"),
        call(0, "}"),
    ]
    assert placed(pieces, end=False) == [
        call(0, "{", name="f"),
        call(0, "}"),
        call(1, "[", name="g"),
        call(1, "]"),
        TextPiece("between", 1),
    ]


def test_at_the_end_everything_held_goes_in_order_though_arguments_never_completed():
    pieces: list[Piece] = [
        call(0, '{"cut": ', name="f"),
        call(1, '{"also": ', name="g"),
        TextPiece("text", 1),
        call(2, "{}", name="h"),
        call(1, "tru"),
    ]
    held = placed(pieces, end=False)
    assert held == pieces[:1]
    assert placed(pieces) == [pieces[0], pieces[1], pieces[4], pieces[2], pieces[3]]


def test_a_fragment_of_a_call_already_stopped_is_left_out_and_nothing_else_is():
    pieces: list[Piece] = [call(0, "{}", name="f"), TextPiece("x", 1), call(0, " "), call(0, "}")]
    assert placed(pieces) == pieces[:2]


def test_a_call_with_no_arguments_yet_holds_the_next_one_until_they_come():
    pieces: list[Piece] = [call(0, name="f"), call(1, name="g"), call(1, "{}"), call(0, "{}")]
    assert placed(pieces, end=False) == [pieces[0], pieces[3], pieces[1], pieces[2]]
