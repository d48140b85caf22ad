"""What a stored response said, as a ``previous_response_id`` continues it: read from its
log's small events (its text deltas, its calls' openings and argument deltas), the same as
its terminal event's object tells, whatever the response held and however it ended."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.delivery.formats import Spec, Usage
from replystream.delivery.moderation import Violation
from replystream.delivery.replay import LogEntry
from replystream.delivery.responses_format import ResponsesStreamFormat
from replystream.delivery.responses_log import SAID_SLICE, TERMINAL, said_in_events, said_in_object
from replystream.delivery.responses_objects import ResponseSettings
from replystream.engine.base import TokenLogprob, ToolCallDelta, TopLogprob
from tests.loop_turns import counted_turns

texts = st.text(min_size=1, max_size=8)
pieces = st.lists(
    st.one_of(
        st.tuples(st.just("text"), texts),
        st.tuples(st.just("logprobs"), texts),
        st.tuples(st.just("thought"), texts),
        st.tuples(st.just("call"), st.integers(0, 2), texts),
    ),
    max_size=30,
)
endings = st.sampled_from(["stop", "length", "error", "moderated"])


def _logprob(text: str) -> tuple[TokenLogprob, ...]:
    return (TokenLogprob(text, -0.5, text.encode(), (TopLogprob("x", -1.0, b"x"),)),)


def responded(steps: list[Any], ending: str) -> list[LogEntry]:
    fmt = ResponsesStreamFormat(ResponseSettings("m", 0))
    specs: list[Spec] = fmt.started("r1")
    opened: set[int] = set()
    for step in steps:
        if step[0] == "text":
            specs += fmt.text(step[1], 1)
        elif step[0] == "logprobs":
            specs += fmt.text_logprobs(step[1], 1, _logprob(step[1]))
        elif step[0] == "thought":
            specs += fmt.reasoning(step[1], 1)
        else:
            index, arguments = step[1], step[2]
            first = index not in opened
            opened.add(index)
            call_id, name = (f"call_{index}", f"tool{index}") if first else (None, None)
            specs += fmt.tool_call(ToolCallDelta(index, call_id, name, arguments))
    usage = Usage(3, len(steps))
    if ending == "error":
        specs += fmt.error("it broke", "upstream_broken")
    elif ending == "moderated":
        specs += fmt.moderated(Violation("banned", "a phrase", 0, 0), usage)
    else:
        specs += fmt.finished(ending, usage)
    return [LogEntry(seq, event, data) for seq, (event, data) in enumerate(specs, 1)]


@settings(max_examples=300, deadline=None)
@given(pieces, endings)
def test_what_the_events_say_is_what_the_terminal_object_says(steps: Any, ending: str) -> None:
    entries = responded(steps, ending)
    [terminal] = [entry for entry in entries if entry.event in TERMINAL]
    told = said_in_object(json.loads(terminal.data)["response"])
    assert asyncio.run(said_in_events(entries)) == told


async def test_a_long_log_is_read_with_turns_of_the_loop_between() -> None:
    steps = [("logprobs", f"w{i} ") for i in range(4 * SAID_SLICE)]
    entries = responded(steps, "stop")
    async with counted_turns() as turns:
        said = await said_in_events(entries)
        assert turns() >= 4
    assert said.text == "".join(text for _, text in steps)
