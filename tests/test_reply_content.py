"""A reply's content in the order it was made: text, tool calls and stretches of thinking."""

from __future__ import annotations

from replystream.delivery.reply_content import Thought, Thoughts, in_order
from replystream.delivery.tool_calls import ToolCall


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
