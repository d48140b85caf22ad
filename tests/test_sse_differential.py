"""`EventParser` against a literal reading of the standard, over random streams and chunkings.

`tests/whatwg_reference.py` walks a whole stream character by character as the WHATWG text
reads. Here random streams, biased toward the pieces that matter to the format (field names,
colons, spaces, every line end, NUL, BOM, multi-byte and invalid UTF-8), go through both, and
the same stream fed in random pieces must give the parser's whole-stream result exactly. The
size limit is checked the same way, and for memory with a never-ending line.
"""

from __future__ import annotations

import itertools
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.sse import Event, EventParser, EventTooLarge
from tests.whatwg_reference import Interpretation, interpret, pending_peaks, utf8_decode

PIECES = [
    b"data",
    b"event",
    b"id",
    b"retry",
    b"message",
    b":",
    b" ",
    b"\r",
    b"\n",
    b"\r\n",
    b"\n\n",
    b"\0",
    b"\xef\xbb\xbf",  # BOM
    b"\xef\xbb",  # a BOM cut short
    b"data: ",
    b"data:",
    b"id: ",
    b"retry: ",
    b"0",
    b"7",
    b"42",
    b"x",
    "é".encode(),
    "€".encode(),
    "😀".encode(),
    "😀".encode()[:2],  # a character cut short
    b"\xff",
    b"\x80",
    b"\xc0\xaf",  # overlong
    b"\xed\xa0\x80",  # an encoded surrogate
    b"\xf4\x90\x80\x80",  # beyond U+10FFFF
]

piece = st.one_of(st.sampled_from(PIECES), st.binary(max_size=3))
line_end = st.sampled_from([b"\n", b"\r", b"\r\n"])
# Field lines as a server writes them, or nearly: these dispatch events often, where random
# pieces mostly make lines the parser ignores.
field_line = st.tuples(
    st.sampled_from([b"data", b"event", b"id", b"retry", b"", b"dat", b"data ", b"Data"]),
    st.sampled_from([b": ", b":", b"", b":  ", b": :"]),
    st.lists(piece, max_size=4).map(b"".join),
    line_end,
).map(b"".join)
lines = st.lists(st.one_of(field_line, line_end), max_size=16).map(b"".join)
streams = st.tuples(
    st.sampled_from([b"", b"", b"\xef\xbb\xbf", b"\xef\xbb\xbf\xef\xbb\xbf"]),
    st.one_of(st.lists(piece, max_size=80).map(b"".join), lines),
    st.lists(piece, max_size=3).map(b"".join),  # whatever a cut-off stream ends with
).map(b"".join)

FAST = settings(max_examples=200, deadline=None)


def cut(stream: bytes, points: list[int]) -> list[bytes]:
    """``stream`` split at ``points`` (any order, repeats give empty pieces)."""
    edges = [0, *sorted(min(p, len(stream)) for p in points), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(edges)]


def run(pieces: list[bytes], max_event_size: int = 1 << 20):
    """Feed ``pieces``, then close: (events, last event ID string and buffer, retry,
    discarded) or the error type."""
    parser = EventParser(max_event_size=max_event_size)
    events: list[Event] = []
    try:
        for piece in pieces:
            events += parser.feed(piece)
    except EventTooLarge:
        assert parser.closed
        return EventTooLarge
    parser.close()
    return (
        events,
        parser.last_event_id,
        parser.last_event_id_buffer,
        parser.retry,
        parser.discarded_incomplete,
    )


def expected(reference: Interpretation):
    events = [Event(e.data, e.type, e.last_event_id) for e in reference.events]
    return (
        events,
        reference.last_event_id_string,
        reference.last_event_id_buffer,
        reference.reconnection_time,
        reference.discarded_incomplete,
    )


def test_reference_decoder_matches_pythons_replacement_on_known_cases() -> None:
    # The Encoding standard's examples of U+FFFD per maximal subpart.
    assert utf8_decode(b"\xef\xbb\xbf\xef\xbb\xbfa") == "\ufeffa"
    assert utf8_decode(b"\xf0\x9f\x98") == "\ufffd"
    assert utf8_decode(b"\xf0\x9f\x98A") == "\ufffdA"
    assert utf8_decode(b"\xc0\xaf") == "\ufffd\ufffd"
    assert utf8_decode(b"\xed\xa0\x80") == "\ufffd\ufffd\ufffd"


@FAST
@given(stream=streams)
def test_whole_stream_parses_as_the_standard_reads(stream: bytes) -> None:
    assert run([stream]) == expected(interpret(stream))


@FAST
@given(stream=streams, points=st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_gives_the_same_events_id_and_retry(stream: bytes, points: list[int]) -> None:
    whole = run([stream])
    assert run(cut(stream, points)) == whole
    assert run([stream[i : i + 1] for i in range(len(stream))]) == whole


@FAST
@given(
    stream=streams,
    points=st.lists(st.integers(0, 400), max_size=8),
    max_event_size=st.integers(1, 48),
)
def test_size_limit_is_the_same_in_every_chunking_and_only_when_exceeded(
    stream: bytes, points: list[int], max_event_size: int
) -> None:
    whole = run([stream], max_event_size)
    assert run(cut(stream, points), max_event_size) == whole
    complete_peak, peak_with_partial = pending_peaks(stream)
    if complete_peak > max_event_size:
        assert whole is EventTooLarge
    if whole is EventTooLarge:
        # The partial line may end in bytes the parser still holds undecoded, so the
        # reference (which decodes them as U+FFFD at end of file) may count one more.
        assert peak_with_partial > max_event_size
    else:
        assert whole == expected(interpret(stream))


def test_python_decoder_agrees_with_the_standards_on_random_bytes() -> None:
    # Not hypothesis: every 1- and 2-byte string, and the 3-byte strings built from
    # the bytes where UTF-8's boundaries lie.
    edges = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF]
    edges += [0xE0, 0xED, 0xEE, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF]
    samples = [bytes([a]) for a in range(256)]
    samples += [bytes([a, b]) for a in range(256) for b in edges]
    samples += [bytes([a, b, c]) for a in edges for b in edges for c in edges]
    for sample in samples:
        assert sample.decode("utf-8", "replace") == utf8_decode(sample), sample


# Bounded memory against a hostile stream

MIB = 1 << 20
CHUNK = 64 * 1024


def _fed_until_too_large(chunk: bytes, first: bytes = b"") -> tuple[int, int]:
    """Feed up to 64 MiB of ``chunk`` with a 1 MiB limit; return (bytes fed, traced peak)."""
    parser = EventParser(max_event_size=MIB)
    tracemalloc.start()
    try:
        with pytest.raises(EventTooLarge):
            parser.feed(first)
            for _ in range(64 * MIB // len(chunk)):
                parser.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parser.closed
    return parser.bytes_fed, peak


def test_a_line_that_never_ends_raises_within_about_the_limit() -> None:
    fed, peak = _fed_until_too_large(b"a" * CHUNK, first=b"data: ")
    assert fed <= MIB + CHUNK + 6  # stopped at the first chunk past the limit
    assert peak < MIB + 4 * CHUNK  # the held line, plus about one chunk in flight


def test_an_event_that_never_ends_raises_within_about_the_limit() -> None:
    line = b"data: " + b"b" * 1000 + b"\n"
    fed, peak = _fed_until_too_large(line * (CHUNK // len(line)))
    assert fed <= MIB + 2 * CHUNK
    # Each line of the pending event is its own str (1,049 bytes for 1,000 characters).
    assert peak < 1.1 * MIB + 4 * CHUNK
