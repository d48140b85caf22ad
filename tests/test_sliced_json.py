"""A reply's large lists, made in slices or written as they came: the bytes ``json.dumps``
writes of the same body made whole, and the event loop turning between slices."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.delivery.openai_formats import completion_body
from replystream.delivery.sliced_json import SLICE, Sliced, Written, dumps_sliced, dumps_written
from replystream.engine.base import TokenLogprob, TopLogprob
from tests.loop_turns import counted_turns

leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()  # control characters, lone surrogates, the tag's own first characters
    | st.just("\x00part-")
)


def _keep(items: Sequence[Any]) -> list[Any]:
    return list(items)


def _pairs(items: Sequence[Any]) -> list[Any]:
    """Items that are not the source's own, some slices none at all."""
    return [{"at": item, "again": [item]} for item in items if not isinstance(item, bool)]


@st.composite
def sliced_lists(draw: st.DrawFn, values: st.SearchStrategy[Any]) -> Sliced[Any]:
    source = draw(st.lists(values, max_size=3 * SLICE + 1))
    return Sliced(source, draw(st.sampled_from([_keep, _pairs])))


bodies = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=5), inner, max_size=4)
        | sliced_lists(inner)
    ),
    max_leaves=40,
)


def made_whole(value: Any) -> Any:
    if isinstance(value, Sliced):
        return value.whole()  # its items as made: a Sliced among them is not written
    if isinstance(value, dict):
        return {key: made_whole(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [made_whole(item) for item in value]
    return value


@settings(max_examples=300, deadline=None)
@given(bodies)
def test_the_bytes_are_json_dumps_of_the_body_made_whole(body: Any) -> None:
    try:
        expected = json.dumps(made_whole(body), separators=(",", ":")).encode()
    except TypeError:  # a Sliced inside a Sliced's items: not written either way
        with pytest.raises(TypeError):
            asyncio.run(dumps_sliced(body))
        return
    assert asyncio.run(dumps_sliced(body)) == expected


def _tokens(count: int, top: int) -> tuple[TokenLogprob, ...]:
    words = ["the", " cat", ' "sat"', " \u00e9t\u00e9", "\n", " 1e-05"]
    made = []
    for i in range(count):
        alternatives = tuple(
            TopLogprob(words[(i + j) % len(words)], -(i + j) / 7, words[j % 6].encode())
            for j in range(top)
        )
        word = words[i % len(words)]
        made.append(TokenLogprob(word, -i / 3 - 1e-5, word.encode(), alternatives))
    made.append(TokenLogprob("\ufffd", -math.pi, b"\xe2\x80", ()))  # half a character
    return tuple(made)


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_whole_replys_body_with_log_probabilities_is_what_it_was(kind: Any) -> None:
    """The body builders' sliced log probabilities, written, are the eager body's bytes."""
    made = _tokens(5 * SLICE + 3, 20)
    body = completion_body(
        kind,
        reply_id="r1",
        model="m",
        created=1,
        text="".join(t.token for t in made),
        usage=None,
        logprobs=made,
        text_offset_from=12,
    )
    written = json.loads(asyncio.run(dumps_sliced(body)))
    logprobs = written["choices"][0]["logprobs"]
    if kind == "chat":
        entries = logprobs["content"]
        assert [e["token"] for e in entries] == [t.token for t in made]
        assert [len(e["top_logprobs"]) for e in entries] == [len(t.top) for t in made]
        assert entries[7]["top_logprobs"][3]["bytes"] == list(made[7].top[3].bytes)
    else:
        assert len(logprobs["top_logprobs"]) == len(made) == len(logprobs["text_offset"])
        assert logprobs["text_offset"][0] == 12
        assert logprobs["top_logprobs"][-1] == {"bytes:\\xe2\\x80": -math.pi}
    assert (
        asyncio.run(dumps_sliced(body))
        == json.dumps(made_whole(body), separators=(",", ":")).encode()
    )


async def test_the_loop_turns_between_slices() -> None:
    async with counted_turns() as turns:
        await dumps_sliced({"a": Sliced(list(range(10 * SLICE)), _keep)})
        assert turns() >= 9  # one between each two of the ten slices
    async with counted_turns() as turns:
        await dumps_sliced({"a": list(range(10 * SLICE))})  # nothing sliced: one go
        assert turns() == 0


def test_what_json_cannot_write_is_refused_as_json_dumps_refuses_it() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        asyncio.run(dumps_sliced({"a": object()}))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(leaves, max_size=4), max_size=6), bodies)
def test_a_list_written_as_it_came_is_the_list_made_whole(batches: Any, rest: Any) -> None:
    """Items added a batch at a time (some batches empty), put in a body beside anything else
    a body holds: the text json.dumps writes of the whole list there."""
    written = Written()
    for batch in batches:
        written.add(json.dumps(batch, separators=(",", ":")))
    items = [item for batch in batches for item in batch]
    body = {"rest": rest, "items": written, "again": [written]}
    try:
        expected = json.dumps(
            {"rest": made_whole(rest), "items": items, "again": [items]}, separators=(",", ":")
        )
    except TypeError:
        return  # a Sliced inside a Sliced's items (above)
    assert asyncio.run(dumps_sliced(body)) == expected.encode()
    if _holds_sliced(rest):
        with pytest.raises(TypeError, match="dumps_sliced"):
            dumps_written(body)  # which does not wait, so cannot slice
    else:
        assert dumps_written(body) == expected


def _holds_sliced(value: Any) -> bool:
    if isinstance(value, Sliced):
        return True
    if isinstance(value, dict):
        return any(_holds_sliced(item) for item in value.values())
    return isinstance(value, list) and any(_holds_sliced(item) for item in value)
