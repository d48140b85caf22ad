"""A reply's content in the order it was made: text, tool calls and stretches of thinking."""

from __future__ import annotations

import time

from replystream.delivery.reply_content import Thought, Thoughts, in_order
from replystream.delivery.responses_format import ResponsesStreamFormat
from replystream.delivery.responses_objects import ResponseSettings
from replystream.delivery.tool_calls import ToolCall, ToolCalls
from replystream.engine.base import ToolCallDelta


def test_pieces_of_thinking_join_into_stretches_that_text_or_a_call_interrupts():
    thoughts = Thoughts()
    assert thoughts.add("a", 0, 0)[1] is True
    assert thoughts.add("b", 0, 0)[1] is False
    thoughts.interrupt()
    stretch, began = thoughts.add("c", 5, 1)
    assert began and stretch == Thought("c", 5, 1)
    assert thoughts.whole() == (Thought("ab", 0, 0), Thought("c", 5, 1))


def test_in_order_puts_each_stretch_where_it_came_among_text_and_calls():
    first = ToolCall(0, "c0", "f", text_at=5)
    second = ToolCall(1, "c1", "g", text_at=5)
    thoughts = (
        Thought("plan", 0, 0),  # before any text
        Thought("between", 5, 1),  # after the first call, before the second (same place)
        Thought("after", 11, 2),  # after both calls and more text
    )
    content = in_order("Hello world", (first, second), thoughts)
    assert content == [thoughts[0], "Hello", first, thoughts[1], second, " world", thoughts[2]]


def test_in_order_without_thinking_is_text_cut_at_each_call():
    call = ToolCall(0, "c0", "f", text_at=3)
    assert in_order("abcdef", (call,)) == ["abc", call, "def"]
    assert in_order("", (call,)) == [call]  # no empty piece of text


def test_a_stretch_past_the_text_kept_comes_at_its_end():
    # Text after a stop string is cut from the reply; thinking made after it stays last.
    late = Thought("late", 40, 0)
    assert in_order("short", (), (late,)) == ["short", late]


def seconds_to_add(count: int) -> float:
    """CPU seconds to join ``count`` fragments into one call's arguments and one stretch of
    thinking, then read them."""
    calls, thoughts = ToolCalls(), Thoughts()
    began = time.process_time()
    calls.add(ToolCallDelta(0, "c0", "write_file", ""))
    for _ in range(count):
        calls.add(ToolCallDelta(0, None, None, "abcd"))
        thoughts.add("abcd", 0, 0)
    assert len(calls.whole()[0].arguments) == len(thoughts.whole()[0].text) == 4 * count
    return time.process_time() - began


def test_fragments_cost_the_same_each_however_many_came_before():
    # A file a tool writes (its arguments) or a reasoning model's thinking comes in tens of
    # thousands of fragments; each appended to one string copied all the text before it:
    # 100,000 took seconds. Four times the fragments take about four times as long.
    seconds_to_add(1_000)  # warm
    assert seconds_to_add(160_000) < 8 * seconds_to_add(40_000) + 0.05


def seconds_to_think_after_text(count: int) -> float:
    """CPU seconds a Responses stream takes to write ``count`` pieces of thinking that come
    after as many pieces of text (a reasoning model thinking again mid-reply)."""
    fmt = ResponsesStreamFormat(ResponseSettings(model="m", created_at=0))
    fmt.started("r1")
    for _ in range(count):
        fmt.text("word ", 1)
    began = time.process_time()
    for _ in range(count):
        fmt.reasoning("hmm ", 1)
    return time.process_time() - began


def test_thinking_after_long_text_costs_each_piece_the_same():
    # Where each stretch of thinking began was the length of all the text before it, summed
    # again for every piece: thinking after 40,000 pieces of text cost each piece 40,000.
    seconds_to_think_after_text(1_000)  # warm
    assert seconds_to_think_after_text(40_000) < 8 * seconds_to_think_after_text(10_000) + 0.05
