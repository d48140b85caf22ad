"""Whatever text a model makes, a client reads exactly that text, in exactly the events sent.

Replies made of hostile tokens (CR, LF, CRLF, blank lines, ``data: [DONE]``, ``event: error``,
``id:``/``retry:`` lines, NUL, BOMs, lone surrogates, and the raw bytes of a byte-level
tokenizer, invalid UTF-8 included) go through the real server on a loopback socket and back
through the real client parser (`EventParser` and `interpret_event`). Every route must give
the joined tokens exactly, with one text event per token, nothing extra, no early end, and its
end marker last.

Invalid UTF-8 is the one thing that changes, and not in the server: the built-in engine's
detokenizer (`engine.tokenizer.IncrementalDetokenizer`) holds a token that ends inside a
character until it completes, and replaces invalid bytes with U+FFFD, one per maximal invalid
subsequence (Python's ``errors="replace"``, which is also the WHATWG decoder's rule). A client
reads what decoding all the reply's bytes at once gives.

Lone surrogates survive, with one exception that is JSON's, not the server's: a JSON string
is UTF-16 code units (RFC 8259, section 7), so a high surrogate written just before a low one
in the same string is read back as the one character the pair spells (`as_json_reads`).

Each test starts one server and feeds each example through a `ScriptedEngine` whose script
it sets first.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from operator import not_
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replystream.client.formats import Meaning, interpret_body, interpret_event
from replystream.client.transport import http_request
from replystream.server import create_app, running
from replystream.sse import Event, EventParser
from tests.scripted_engine import ScriptedEngine, decoded, detokenize
from tests.whatwg_reference import utf8_decoder

NASTY = [
    "\r",
    "\n",
    "\r\n",
    "\n\n",
    "\r\r",
    "\r\n\r\n",
    "data: [DONE]",
    "\n\ndata: [DONE]\n\n",
    "[DONE]",
    "event: error",
    "\nevent: error\ndata: {}\n\n",
    'data: {"error": {"message": "x", "code": "y"}}\n\n',
    "event: done\n\n",
    "id: 999\n",
    "retry: 1\n",
    ": comment\n\n",
    "data:",
    "",
    "\0",
    "\ufeff",
    "\ufffd",
    "\ud800",
    "\udfff",
    "\udbff\udc00",  # a surrogate pair as two code points: still not a character
    "\u2028\u2029\x85\x0b\x0c",  # line ends elsewhere, not in an event stream
    '"',
    "\\",
    '\\"',
    "\x7f",
    "😀",
]
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3)
token = st.one_of(st.sampled_from(NASTY), st.text(max_size=6), surrogates)
replies = st.lists(token, max_size=24)

BYTE_PIECES = [
    b"\r",
    b"\n",
    b"\r\n",
    b"\0",
    b"data: [DONE]\n\n",
    b"event: error\n",
    b"\xff",
    b"\x80",
    b"\xc3",
    b"\xa9",
    b"\xe2\x82",
    b"\xac",
    b"\xf0\x9f",
    b"\x98\x80",
    b"\xed\xa0\x80",
    b"\xef\xbb\xbf",
    b"\xc0\xaf",
]
byte_replies = st.lists(st.one_of(st.sampled_from(BYTE_PIECES), st.binary(max_size=4)), max_size=24)

EXAMPLES = settings(
    max_examples=100,
    deadline=None,
    # One server serves every example: that is the point of the fixture.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

TEXT = "text"


def as_json_reads(text: str) -> str:
    """``text`` as any JSON reader gets it back: adjacent surrogates joined, lone ones kept."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def test_json_joins_adjacent_surrogates_and_keeps_lone_ones() -> None:
    for text in ["\udbff\udc00", "\ud800", "a\udfff\ud800b", "\U0010fc00", "\r\n\0"]:
        assert json.loads(json.dumps(text)) == as_json_reads(text)
    assert as_json_reads("\udbff\udc00") == "\U0010fc00"
    assert as_json_reads("\udc00\udbff") == "\udc00\udbff"


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, ScriptedEngine]]:
    engine = ScriptedEngine()
    async with running(create_app(engine)) as url:
        yield url, engine


async def read_stream(url: str, body: dict[str, Any] | None = None) -> list[Event]:
    """Every event of one streamed reply (GET, or POST of ``body``); the stream must end cleanly."""
    method, payload, headers = "GET", b"", {}
    if body is not None:
        method, payload = "POST", json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
    parser = EventParser()
    events: list[Event] = []
    async with http_request(url, method=method, body=payload, headers=headers) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        async for chunk in response:
            events += parser.feed(chunk.data)
    parser.close()
    assert not parser.discarded_incomplete  # the stream ended after a whole event
    return events


async def read_body(url: str, body: dict[str, Any] | None = None) -> Meaning:
    """The meaning of one buffered reply's body (GET, or POST of ``body``)."""
    method, payload, headers = "GET", b"", {}
    if body is not None:
        method, payload = "POST", json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
    async with http_request(url, method=method, body=payload, headers=headers) as response:
        assert response.status == 200
        raw = b"".join([chunk.data async for chunk in response])
    return interpret_body(raw)


def shown(tokens: list[str]) -> list[str]:
    """The tokens that make a text event: one with no text is counted with the next text."""
    return [token for token in tokens if token]


def check_events(events: list[Event], tokens: list[str], *, opening: int, closing: list[str]):
    """``opening`` non-text events, one text event per token, then ``closing`` event kinds."""
    meanings = [interpret_event(event) for event in events]
    kinds = [meaning.kind for meaning in meanings]
    assert kinds == (["other"] * opening + [TEXT] * len(tokens) + closing), (
        f"events {[(e.type, e.data) for e in events]}"
    )
    texts = [m.text for m in meanings[opening : opening + len(tokens)]]
    assert texts == [as_json_reads(t) for t in tokens]
    assert meanings[-1].kind == "done"


@EXAMPLES
@given(tokens=replies, numbered=st.booleans())
async def test_lab_stream_carries_any_text_exactly(served, tokens: list[str], numbered: bool):
    url, engine = served
    engine.say(tokens)
    events = await read_stream(f"{url}/stream?ids={int(numbered)}")
    # A numbered stream opens with its ``reply`` event; the article's framing has none.
    check_events(events, shown(tokens), opening=int(numbered), closing=["done"])
    assert events[-1] == Event("[DONE]", "message", str(len(events)) if numbered else "")
    if numbered:
        assert [e.id for e in events] == [str(n) for n in range(1, len(events) + 1)]


@EXAMPLES
@given(tokens=replies)
async def test_native_stream_carries_any_text_exactly(served, tokens: list[str]):
    url, engine = served
    engine.say(tokens)
    events = await read_stream(f"{url}/v1/replies", {"prompt": "hi"})
    assert [e.type for e in events] == ["reply"] + ["token"] * len(shown(tokens)) + [
        "usage",
        "done",
    ]
    check_events(events, shown(tokens), opening=1, closing=["usage", "done"])
    assert json.loads(events[-2].data)["completion_tokens"] == len(tokens)
    assert json.loads(events[-1].data) == {"finish_reason": "stop"}


@EXAMPLES
@given(tokens=replies, batch_tokens=st.integers(1, 4), holdback_tokens=st.integers(0, 3))
async def test_native_stream_batched_and_held_back_carries_any_text_exactly(
    served, tokens: list[str], batch_tokens: int, holdback_tokens: int
):
    url, engine = served
    engine.say(tokens)
    body = {"prompt": "hi", "batch_tokens": batch_tokens, "holdback_tokens": holdback_tokens}
    events = await read_stream(f"{url}/v1/replies", body)
    types = [e.type for e in events]
    assert types[0] == "reply" and types[-2:] == ["usage", "done"]
    assert set(types[1:-2]) <= {"token"}
    meanings = [interpret_event(e) for e in events[1:-2]]
    assert as_json_reads("".join(m.text for m in meanings)) == as_json_reads("".join(tokens))
    # Every token is in an event but those with no text at the reply's end (unless held
    # text released at the end took them).
    trailing = len(tokens) - len(list(itertools.dropwhile(not_, reversed(tokens))))
    assert len(tokens) - trailing <= sum(m.tokens for m in meanings) <= len(tokens)


@EXAMPLES
@given(tokens=replies)
async def test_buffered_bodies_carry_any_text_exactly(served, tokens: list[str]):
    url, engine = served
    engine.say(tokens)
    whole = Meaning("done", as_json_reads("".join(tokens)))
    native = await read_body(f"{url}/v1/replies", {"prompt": "hi", "stream": False})
    assert native == replace(whole, usage=len(tokens))  # the native body has its usage
    assert await read_body(f"{url}/wait") == whole


@EXAMPLES
@given(tokens=replies)
async def test_chat_completion_stream_carries_any_text_exactly(served, tokens: list[str]):
    url, engine = served
    engine.say(tokens)
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = await read_stream(f"{url}/v1/chat/completions", body)
    assert all(e.type == "message" for e in events)
    chunks = [json.loads(e.data) for e in events[:-1]]
    # The role chunk, one content chunk per token, the finish chunk, then [DONE].
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texted = shown(tokens)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes == [None] * (len(texted) + 1) + ["stop"]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]]
    assert contents == [as_json_reads(t) for t in texted]
    assert events[-1].data == "[DONE]"
    kinds = [interpret_event(e).kind for e in events]
    assert kinds == [TEXT] * (len(texted) + 2) + ["done"]
    texts = [interpret_event(e).text for e in events]
    assert texts == ["", *map(as_json_reads, texted), "", ""]  # role, tokens, finish, [DONE]


@EXAMPLES
@given(tokens=replies)
async def test_legacy_completion_stream_carries_any_text_exactly(served, tokens: list[str]):
    url, engine = served
    engine.say(tokens)
    body = {"model": "scripted", "prompt": "hi", "stream": True}
    events = await read_stream(f"{url}/v1/completions", body)
    assert all(e.type == "message" for e in events)
    # An empty first chunk, one chunk per token, the finish chunk, then [DONE].
    check_events(events, ["", *shown(tokens), ""], opening=0, closing=["done"])
    finishes = [json.loads(e.data)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes == [None] * (len(shown(tokens)) + 1) + ["stop"]


@EXAMPLES
@given(tokens=replies)
async def test_chat_completion_body_carries_any_text_exactly(served, tokens: list[str]):
    url, engine = served
    engine.say(tokens)
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    meaning = await read_body(f"{url}/v1/chat/completions", body)
    assert meaning == Meaning("done", as_json_reads("".join(tokens)), usage=len(tokens))


@EXAMPLES
@given(pieces=byte_replies)
async def test_byte_level_tokens_arrive_as_their_bytes_decoded_with_replacement(
    served, pieces: list[bytes]
):
    url, engine = served
    engine.say_bytes(pieces)
    expected = decoded(pieces)
    # Python's replacement is the WHATWG decoder's: one U+FFFD per maximal invalid subpart.
    assert expected == utf8_decoder(b"".join(pieces))
    events = await read_stream(f"{url}/v1/replies", {"prompt": "hi"})
    # One token event per token with text: one whose bytes are an unfinished character is
    # counted with the text that completes it.
    check_events(events, shown(detokenize(pieces)), opening=1, closing=["usage", "done"])
    assert "".join(interpret_event(e).text for e in events) == expected
    lab = await read_stream(f"{url}/stream")
    check_events(lab, shown(detokenize(pieces)), opening=1, closing=["done"])
