"""A character cut between two chunks by an upstream that writes JSON as Node.js does: each
half of its UTF-16 pair a lone surrogate escape (``"\\ud83d"``, then ``"\\ude00"``), each
event valid JSON. The halves are joined into the one character; a half whose other never
comes is U+FFFD; neither ends the reply. Over a real relay and scripted aiohttp upstreams on
loopback sockets, and on the chunk reader alone for reads cut anywhere."""

from __future__ import annotations

import json
from typing import Any

import pytest

from replystream.engine.upstream_chunks import ChunkReader
from tests.sse_client import post_events
from tests.test_upstream_routing import Scripted, relay

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def event(content: str | None = None, finish: str | None = None, **delta: Any) -> bytes:
    """A chat chunk as Node.js's ``JSON.stringify`` writes it: every character outside
    ASCII escaped here, so a lone surrogate is a lone escape (``ensure_ascii``)."""
    if content is not None:
        delta["content"] = content
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


# "Hi 😀 there 😀!": its first emoji cut between two chunks, its second too, within texts.
SPLIT = [
    event("Hi "),
    event("there "),  # a template to learn: common chunks read by their bytes
    event("\ud83d"),
    event("\ude00"),
    event(" there \ud83d"),
    event("\ude00!"),
]


async def relayed(events: list[bytes]) -> tuple[str, bytes]:
    async with relay([Scripted([*events, event(None, "stop")])]) as url:
        got = await post_events(f"{url}/v1/chat/completions", CHAT)
    assert got.status == 200
    return got.chat_text, got.raw


async def test_a_character_split_between_chunks_is_joined_into_the_one_character():
    text, raw = await relayed(SPLIT)
    assert text == "Hi there \U0001f600 there \U0001f600!"
    assert b"upstream_bad_chunk" not in raw and b'"finish_reason":"stop"' in raw


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([event("a\ud83d"), event("b")], "a\ufffdb"),  # a high half, then no low one
        # The same after common chunks taught their bytes, and with one more after it.
        ([event("x"), event("y"), event("a\ud83d"), event("b"), event("c")], "xya\ufffdbc"),
        ([event("a"), event("\ude00b")], "a\ufffdb"),  # a low half with no high one before
        ([event("a\ud83dz\ude00b")], "a\ufffdz\ufffdb"),  # lone halves within a text
        ([event("a"), event("\ud83d")], "a\ufffd"),  # a high half, then the finish
        ([event("\ud83d"), event("\ud83d"), event("\ude00")], "\ufffd\U0001f600"),
    ],
)
async def test_a_half_of_a_character_alone_is_a_replacement_character(
    events: list[bytes], expected: str
):
    text, raw = await relayed(events)
    assert text == expected
    assert b"upstream_bad_chunk" not in raw and b'"finish_reason":"stop"' in raw


async def test_a_lone_half_in_thinking_is_a_replacement_character_not_an_error():
    events = [event(reasoning_content="x\ud83d"), event("ok")]
    text, raw = await relayed(events)
    assert text == "ok" and b"upstream_bad_chunk" not in raw


def test_reads_cut_anywhere_make_the_same_text_and_tokens():
    body = b"".join([*SPLIT, event(None, "stop"), b"data: [DONE]\n\n"])
    for cut in range(1, len(body)):
        reader = ChunkReader(name="http://upstream.test/v1", max_event_size=1 << 16)
        reader._take(body[:cut], 0.0)
        reader._take(body[cut:], 0.0)
        deltas = list(reader._pending)
        assert "".join(d.text for d in deltas) == "Hi there \U0001f600 there \U0001f600!"
        assert sum(d.tokens for d in deltas) == len(SPLIT)  # one token per chunk, as ever
        assert deltas[-1].finish_reason == "stop"


def test_an_event_that_is_not_json_is_still_a_bad_chunk():
    for data in (b'data: {"choices": "\\ud83d\n\n', b"data: " + b"[" * 5000 + b'"\\ud83d"\n\n'):
        reader = ChunkReader(name="http://upstream.test/v1", max_event_size=1 << 16)
        reader._take(data, 0.0)
        assert reader._error is not None and reader._error.code == "upstream_bad_chunk"
