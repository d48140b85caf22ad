"""A relayed stream's common chunks read by their bytes (``upstream_chunks``): once a read was
one whole common text chunk (chat's, or a legacy completion's), a read of the same bytes
around another plain text is taken as that text's chunk, with no event parse or JSON.
Whatever an upstream writes, the deltas are those a full parse makes: checked against the
chunks' own texts for any text, any JSON spelling, fields that change from chunk to chunk,
and reads cut anywhere."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.engine.upstream_chunks import ChunkReader, UpstreamStreamError


def reader() -> ChunkReader:
    return ChunkReader(name="http://upstream.test/v1", max_event_size=1 << 20)


def chunk(
    text: str,
    *,
    created: int = 1,
    role: bool = False,
    spaced: bool = False,
    ascii_only: bool = False,
    finish: str | None = None,
    legacy: bool = False,
) -> bytes:
    """A chat chunk, or with ``legacy`` a legacy completion's (its choice's ``text``)."""
    choice: dict[str, Any]
    if legacy:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if finish is None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {
        "id": "chatcmpl-1",
        "object": "text_completion" if legacy else "chat.completion.chunk",
        "created": created,
        "model": "m",
        "choices": [choice],
    }
    separators = (", ", ": ") if spaced else (",", ":")
    return (
        b"data: "
        + json.dumps(body, separators=separators, ensure_ascii=ascii_only).encode()
        + b"\n\n"
    )


def texts_of(source: ChunkReader, reads: list[bytes]) -> tuple[list[str], str | None]:
    """The texts the reader makes of ``reads``, and the finish reason (None: none)."""
    for data in reads:
        source._take(data, 0.0)
    finish = None
    made = []
    for delta in source._pending:
        if delta.text:
            made.append(delta.text)
        if delta.finish_reason is not None:
            finish = delta.finish_reason
    return made, finish


TEXTS = st.text(min_size=0, max_size=12)


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], list[str]]:
    """A reply's chunks (one whole event each) and the texts a client must get."""
    spaced, ascii_only, legacy = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    made: list[bytes] = []
    texts: list[str] = []
    created = 1
    for index, text in enumerate(draw(st.lists(TEXTS, max_size=30))):
        if draw(st.integers(0, 9)) == 0:
            created += 1  # a server that stamps each chunk with the second it was made
        role = index == 0 and not legacy
        made.append(
            chunk(
                text,
                created=created,
                role=role,
                spaced=spaced,
                ascii_only=ascii_only,
                legacy=legacy,
            )
        )
        if text:
            texts.append(text)
    made.append(chunk("", finish="stop", spaced=spaced, legacy=legacy))
    made.append(b"data: [DONE]\n\n")
    return made, texts


@settings(max_examples=300, deadline=None)
@given(stream=streams())
def test_whole_event_reads_give_every_text_as_written(
    stream: tuple[list[bytes], list[str]],
) -> None:
    reads, texts = stream
    assert texts_of(reader(), reads) == (texts, "stop")


@settings(max_examples=300, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_reads_cut_anywhere_give_the_same_texts(
    stream: tuple[list[bytes], list[str]], cuts: list[int]
) -> None:
    whole = b"".join(stream[0])
    points = sorted({c % (len(whole) + 1) for c in cuts} | {0, len(whole)})
    reads = [whole[a:b] for a, b in itertools.pairwise(points) if b > a]
    assert texts_of(reader(), reads) == (stream[1], "stop")


def test_a_text_that_needs_escaping_after_a_learned_chunk_is_read_in_full() -> None:
    reads = [chunk("one "), chunk("two "), chunk('say "hi"\n'), chunk("a\\b"), chunk("é")]
    assert texts_of(reader(), reads)[0] == ["one ", "two ", 'say "hi"\n', "a\\b", "é"]


def test_text_after_the_finish_is_dropped_even_in_the_learned_bytes() -> None:
    reads = [chunk("one "), chunk("two "), chunk("", finish="stop"), chunk("late ")]
    source = reader()
    assert texts_of(source, reads) == (["one ", "two "], None)
    source._take(b"data: [DONE]\n\n", 0.0)
    assert [d.finish_reason for d in source._pending if d.finish_reason] == ["stop"]


def test_a_read_ending_inside_the_next_chunk_teaches_no_bytes_of_it() -> None:
    # Reads that end a few bytes into the next chunk, every other one: the learned read must
    # not be the one that went on, or a later read ending in the same first bytes of a
    # chunk (a chunk's id, created and model are the same in every chunk) loses that chunk.
    cut = 30
    empty, lost = chunk(""), chunk("lost ")
    reads = [chunk("one ") + empty[:cut], empty[cut:], chunk("two ") + lost[:cut], lost[cut:]]
    assert texts_of(reader(), [*reads, chunk("three ")])[0] == ["one ", "two ", "lost ", "three "]


def test_two_events_in_one_read_are_both_read() -> None:
    reads = [chunk("one "), chunk("two ") + chunk("three ")]
    assert texts_of(reader(), reads)[0] == ["one ", "two ", "three "]


def test_a_model_name_equal_to_the_text_is_no_template_and_no_mistake() -> None:
    def body(text: bytes) -> bytes:
        before = b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"'
        return before + text + b'"},"finish_reason":null}]}\n\n'

    reads = [body(b"m"), body(b"x"), body(b"m")]
    assert texts_of(reader(), reads)[0] == ["m", "x", "m"]


def test_an_error_after_a_learned_chunk_still_ends_the_reply() -> None:
    source = reader()
    source._take(chunk("one "), 0.0)
    source._take(chunk("two "), 0.0)
    source._take(b'data: {"error": {"message": "boom"}}\n\n', 0.0)
    assert source._error is not None and source._error.code == "upstream_error"
    assert "boom" in str(source._error)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_learned_chunks_bytes_skip_the_event_parser(legacy: bool) -> None:
    """What the template is for: after one common chunk, the next ones are not parsed."""
    source = reader()
    parser = source._parser
    source._take(chunk("one ", legacy=legacy), 0.0)
    assert parser.events == 1
    for word in ("two ", "three ", "four "):
        source._take(chunk(word, legacy=legacy), 0.0)
    assert parser.events == 1
    assert texts_of(source, [])[0] == ["one ", "two ", "three ", "four "]


@pytest.mark.parametrize(
    ("choice", "says"),
    [
        ({"index": 0, "delta": {"content": 123}}, "whose content is not a string"),
        ({"index": 0, "delta": "hello"}, "whose delta is not an object"),
        ({"index": 0, "text": ["a"]}, "whose text is not a string"),
        (1, "a choice that is not an object"),
        ({"index": 5, "delta": {"content": "a"}}, "a choice of index 5"),
        ({"index": "0", "delta": {"content": "a"}}, "a choice of index 0,"),
        ({"index": 0, "delta": {}, "finish_reason": 123}, "finish reason that is not a string"),
    ],
)
def test_a_choice_that_cannot_be_read_is_a_bad_chunk_not_no_text(choice: Any, says: str):
    # Once skipped as a choice with no text: the reply was reported finished without it.
    source = reader()
    source._take(chunk("one "), 0.0)
    body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "choices": [choice]}
    source._take(b"data: " + json.dumps(body).encode() + b"\n\n", 0.0)
    failure = source._error  # kept: the text before it goes out first
    assert isinstance(failure, UpstreamStreamError) and failure.code == "upstream_bad_chunk"
    assert says in str(failure)
    assert [d.text for d in source._pending] == ["one "]
