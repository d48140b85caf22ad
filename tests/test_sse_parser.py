"""One test per rule of the WHATWG event-stream interpretation, each under several chunkings.

Every stream goes through `feed_chunked`, which parses it whole, one byte at a time, and split
in two at every position, and insists that all of those agree before a test looks at the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from replystream.sse import Event, EventParser, EventTooLarge, SSEError

Chunker = Callable[[bytes], list[list[bytes]]]

CHUNKINGS: dict[str, Chunker] = {
    "whole": lambda s: [[s]],
    "bytewise": lambda s: [[s[i : i + 1] for i in range(len(s))]],
    # Includes the splits at 0 and len(s), so empty feeds are exercised too.
    "split_in_two": lambda s: [[s[:i], s[i:]] for i in range(len(s) + 1)],
}


@pytest.fixture(params=sorted(CHUNKINGS))
def chunks(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@dataclass(frozen=True)
class Parsed:
    events: list[Event]
    last_event_id: str
    last_event_id_buffer: str
    retry: int | None
    at_boundary: bool  # read before close()
    discarded_incomplete: bool  # read after close()
    error: type[SSEError] | None = None


def _run(pieces: list[bytes], max_event_size: int) -> Parsed:
    parser = EventParser(max_event_size=max_event_size)
    events: list[Event] = []
    try:
        for piece in pieces:
            events += parser.feed(piece)
            # A relay skips the parser for a read while it is at rest: never when the bytes
            # so far ended anywhere but after a whole event and whole characters.
            assert not parser.at_rest or parser.at_boundary
    except SSEError as exc:
        # Which events came out before the error depends on the chunking; only the error must not.
        with pytest.raises(SSEError):
            parser.feed(b"")
        return Parsed([], "", "", None, False, False, type(exc))
    assert parser.events == len(events)
    assert parser.bytes_fed == sum(map(len, pieces))
    at_boundary = parser.at_boundary
    parser.close()
    assert parser.closed
    return Parsed(
        events,
        parser.last_event_id,
        parser.last_event_id_buffer,
        parser.retry,
        at_boundary,
        parser.discarded_incomplete,
    )


def feed_chunked(stream: bytes, chunks: str, *, max_event_size: int = 1 << 20) -> Parsed:
    """Parse `stream` under every chunking of the named kind; they must all agree."""
    results = [_run(pieces, max_event_size) for pieces in CHUNKINGS[chunks](stream)]
    for result in results[1:]:
        assert result == results[0]
    return results[0]


def datas(parsed: Parsed) -> list[str]:
    return [event.data for event in parsed.events]


# Dispatch and line ends


def test_blank_line_dispatches_event(chunks: str) -> None:
    parsed = feed_chunked(b"data: hello\n\n", chunks)
    assert parsed.events == [Event("hello", "message", "")]
    assert parsed.at_boundary
    assert not parsed.discarded_incomplete


def test_lf_cr_and_crlf_each_end_one_line(chunks: str) -> None:
    stream = b"data: a\ndata: b\rdata: c\r\ndata: d\n\r\r\ndata: e\r\r"
    assert datas(feed_chunked(stream, chunks)) == ["a\nb\nc\nd", "e"]


def test_crlf_split_across_chunks_is_one_line_end(chunks: str) -> None:
    # Were CR and LF two line ends, the empty line between them would dispatch "a" alone.
    parsed = feed_chunked(b"data: a\r\ndata: b\r\n\r\n", chunks)
    assert datas(parsed) == ["a\nb"]


def test_cr_at_end_of_feed_ends_the_line_without_waiting(chunks: str) -> None:
    parsed = feed_chunked(b"data: a\r\r", chunks)
    assert datas(parsed) == ["a"]
    assert parsed.at_boundary


def test_lf_after_cr_is_only_skipped_once(chunks: str) -> None:
    # CR LF LF is two line ends: the second LF is a blank line and dispatches.
    assert datas(feed_chunked(b"data: a\r\n\n", chunks)) == ["a"]


# Decoding


def test_multibyte_utf8_split_across_chunks_is_decoded(chunks: str) -> None:
    assert datas(feed_chunked("data: é€😀\n\n".encode(), chunks)) == ["é€😀"]


def test_invalid_utf8_is_replaced_with_u_fffd(chunks: str) -> None:
    parsed = feed_chunked(b"data: a\xffb\xe2\x82\nevent: \xc3\n\n", chunks)
    assert parsed.events == [Event("a\ufffdb\ufffd", "\ufffd", "")]


def test_leading_bom_is_stripped(chunks: str) -> None:
    assert datas(feed_chunked(b"\xef\xbb\xbfdata: a\n\n", chunks)) == ["a"]


def test_second_bom_is_part_of_the_first_field_name(chunks: str) -> None:
    # Only one BOM is stripped, so the field is "\ufeffdata": unknown and ignored.
    stream = b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n"
    assert datas(feed_chunked(stream, chunks)) == ["b"]


def test_bom_after_the_start_is_not_stripped(chunks: str) -> None:
    stream = b"data: a\n\n\xef\xbb\xbfdata: b\n\n"
    assert datas(feed_chunked(stream, chunks)) == ["a"]


def test_bom_in_a_value_is_kept(chunks: str) -> None:
    assert datas(feed_chunked(b"data: \xef\xbb\xbfa\n\n", chunks)) == ["\ufeffa"]


# Fields


def test_comment_lines_are_ignored(chunks: str) -> None:
    parsed = feed_chunked(b": hello\ndata: a\n:\n: data: b\n\n", chunks)
    assert datas(parsed) == ["a"]


def test_comment_block_dispatches_nothing_and_ends_on_a_boundary(chunks: str) -> None:
    parsed = feed_chunked(b": keep-alive\n\n: more\n", chunks)
    assert parsed.events == []
    assert parsed.at_boundary


def test_field_without_colon_is_the_name_with_empty_value(chunks: str) -> None:
    parsed = feed_chunked(b"data\ndata\n\nevent\ndata: x\n\n", chunks)
    assert parsed.events == [Event("\n", "message", ""), Event("x", "message", "")]


def test_exactly_one_space_after_the_colon_is_removed(chunks: str) -> None:
    stream = b"data:  two\n\ndata:none\n\nevent:  t\ndata: \n\n"
    parsed = feed_chunked(stream, chunks)
    assert parsed.events == [
        Event(" two", "message", ""),
        Event("none", "message", ""),
        Event("", " t", ""),
    ]


def test_colon_in_the_value_is_kept(chunks: str) -> None:
    assert datas(feed_chunked(b"data: a: b:c\n\n", chunks)) == ["a: b:c"]


def test_data_lines_are_joined_with_lf(chunks: str) -> None:
    assert datas(feed_chunked(b"data: a\ndata:\ndata: b\n\n", chunks)) == ["a\n\nb"]


def test_final_lf_of_the_data_buffer_is_removed(chunks: str) -> None:
    assert datas(feed_chunked(b"data: a\ndata:\n\n", chunks)) == ["a\n"]


def test_empty_data_field_dispatches_an_event_with_empty_data(chunks: str) -> None:
    assert feed_chunked(b"data:\n\n", chunks).events == [Event("", "message", "")]


def test_nul_in_data_is_kept(chunks: str) -> None:
    assert datas(feed_chunked(b"data: a\0b\n\n", chunks)) == ["a\0b"]


def test_type_is_message_by_default(chunks: str) -> None:
    assert feed_chunked(b"data: a\n\n", chunks).events[0].type == "message"


def test_event_field_sets_the_type(chunks: str) -> None:
    assert feed_chunked(b"event: token\ndata: a\n\n", chunks).events[0].type == "token"


def test_empty_event_field_means_message(chunks: str) -> None:
    assert feed_chunked(b"event:\ndata: a\n\n", chunks).events[0].type == "message"


def test_event_type_is_reset_after_dispatch(chunks: str) -> None:
    parsed = feed_chunked(b"event: x\ndata: 1\n\ndata: 2\n\n", chunks)
    assert [e.type for e in parsed.events] == ["x", "message"]


def test_no_dispatch_without_data_but_event_type_is_still_reset(chunks: str) -> None:
    parsed = feed_chunked(b"event: x\n\ndata: 1\n\n", chunks)
    assert parsed.events == [Event("1", "message", "")]


def test_unknown_fields_are_ignored(chunks: str) -> None:
    parsed = feed_chunked(b"foo: bar\ndata: a\nbaz\n\n", chunks)
    assert parsed.events == [Event("a", "message", "")]


def test_field_names_are_case_sensitive(chunks: str) -> None:
    parsed = feed_chunked(b"Data: a\nDATA: b\n\nEvent: x\nID: 3\ndata: c\n\n", chunks)
    assert parsed.events == [Event("c", "message", "")]


def test_parsed_events_carry_no_retry(chunks: str) -> None:
    parsed = feed_chunked(b"retry: 10\ndata: a\n\n", chunks)
    assert parsed.events == [Event("a", "message", "", None)]
    assert parsed.retry == 10


# Last event ID


def test_last_event_id_starts_empty(chunks: str) -> None:
    assert feed_chunked(b"", chunks).last_event_id == ""


def test_dispatched_event_carries_the_last_event_id(chunks: str) -> None:
    parsed = feed_chunked(b"id: 1\ndata: a\n\n", chunks)
    assert parsed.events == [Event("a", "message", "1")]
    assert parsed.last_event_id == "1"


def test_last_event_id_is_carried_across_events(chunks: str) -> None:
    parsed = feed_chunked(b"id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\n", chunks)
    assert [e.id for e in parsed.events] == ["1", "1", "2"]


@pytest.mark.parametrize("empty_id", [b"id", b"id:", b"id: "])
def test_empty_id_field_resets_last_event_id(chunks: str, empty_id: bytes) -> None:
    parsed = feed_chunked(b"id: 1\ndata: a\n\n" + empty_id + b"\ndata: b\n\n", chunks)
    assert [e.id for e in parsed.events] == ["1", ""]
    assert parsed.last_event_id == ""


def test_id_containing_nul_is_ignored(chunks: str) -> None:
    parsed = feed_chunked(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n", chunks)
    assert [e.id for e in parsed.events] == ["1", "1"]
    assert parsed.last_event_id == "1"


def test_id_without_data_sets_last_event_id_without_dispatching(chunks: str) -> None:
    parsed = feed_chunked(b"id: 5\n\n", chunks)
    assert parsed.events == []
    assert parsed.last_event_id == "5"
    assert parsed.at_boundary


def test_an_incomplete_event_sets_the_id_buffer_and_not_the_last_event_id(chunks: str) -> None:
    # Resuming after id 7 would skip an event that never arrived: the spec's last event ID
    # string moves only at a blank line.
    parsed = feed_chunked(b"id: 1\ndata: a\n\nid: 7\ndata: b\n", chunks)
    assert parsed.events == [Event("a", "message", "1")]
    assert parsed.last_event_id == "1"
    assert parsed.last_event_id_buffer == "7"
    assert parsed.discarded_incomplete


# Retry


@pytest.mark.parametrize(("value", "expected"), [(b"1000", 1000), (b"0", 0), (b"007", 7)])
def test_retry_of_ascii_digits_sets_the_reconnection_time(
    chunks: str, value: bytes, expected: int
) -> None:
    parsed = feed_chunked(b"retry: " + value + b"\n\n", chunks)
    assert parsed.retry == expected
    assert parsed.events == []


@pytest.mark.parametrize(
    "value", [b"", b" 10", b"10 ", b"-1", b"1.5", b"1e3", b"10a", "²".encode(), "٣".encode()]
)
def test_retry_that_is_not_all_ascii_digits_is_ignored(chunks: str, value: bytes) -> None:
    parsed = feed_chunked(b"retry: 10\n\nretry: " + value + b"\n\n", chunks)
    assert parsed.retry == 10


def test_retry_field_without_colon_is_ignored(chunks: str) -> None:
    assert feed_chunked(b"retry\n\n", chunks).retry is None


def test_retry_too_long_to_convert_is_ignored(chunks: str) -> None:
    # Past Python's int-conversion limit (4300 digits by default) there is no sane delay.
    stream = b"retry: 5\n\nretry: " + b"9" * 5000 + b"\n\n"
    assert feed_chunked(stream, chunks).retry == 5


# End of stream


def test_empty_stream_is_on_a_boundary(chunks: str) -> None:
    parsed = feed_chunked(b"", chunks)
    assert parsed.at_boundary
    assert not parsed.discarded_incomplete


def test_event_without_its_blank_line_is_discarded_and_reported(chunks: str) -> None:
    parsed = feed_chunked(b"data: a\n\ndata: b\n", chunks)
    assert datas(parsed) == ["a"]
    assert not parsed.at_boundary
    assert parsed.discarded_incomplete


def test_unterminated_last_line_is_discarded_and_reported(chunks: str) -> None:
    parsed = feed_chunked(b"data: a\n\ndata: b", chunks)
    assert datas(parsed) == ["a"]
    assert not parsed.at_boundary
    assert parsed.discarded_incomplete


def test_pending_event_type_alone_is_not_a_boundary(chunks: str) -> None:
    assert not feed_chunked(b"event: x\n", chunks).at_boundary


def test_split_character_at_the_end_is_not_a_boundary(chunks: str) -> None:
    parsed = feed_chunked(b"data: a\n\n\xe2\x82", chunks)
    assert datas(parsed) == ["a"]
    assert not parsed.at_boundary
    assert parsed.discarded_incomplete


def test_partial_bom_is_not_a_boundary(chunks: str) -> None:
    parsed = feed_chunked(b"\xef\xbb", chunks)
    assert not parsed.at_boundary
    assert parsed.discarded_incomplete


@pytest.mark.parametrize(
    ("stream", "at_rest"),
    [
        (b"data: a\n\n", True),
        (b"\xef\xbb\xbfdata: a\n\n: ping\n\n", True),
        (b"data: \xc3\xa9\n\n", True),
        (b"", False),  # a BOM may still come
        (b"data: a\n", False),
        (b"data: a\n\ndata", False),
        (b"data: a\n\n\xc3", False),  # a character cut short
        (b"data: a\r\r", False),  # an LF that comes next is the CR's partner, not a line
    ],
)
def test_at_rest_only_after_a_whole_event_and_whole_characters(
    chunks: str, stream: bytes, at_rest: bool
) -> None:
    # What a relay asks before reading the next bytes as a new event without the parser:
    # true at the end of every whole event (else it never takes that short cut), and false
    # wherever the parser holds anything the next bytes would go on from.
    for pieces in CHUNKINGS[chunks](stream):
        parser = EventParser()
        for piece in pieces:
            parser.feed(piece)
        assert parser.at_rest is at_rest, pieces


def test_close_is_idempotent_and_feed_after_close_raises(chunks: str) -> None:
    for pieces in CHUNKINGS[chunks](b"data: a\n\n"):
        parser = EventParser()
        for piece in pieces:
            parser.feed(piece)
        parser.close()
        parser.close()
        assert not parser.discarded_incomplete
        with pytest.raises(SSEError, match="closed"):
            parser.feed(b"data: b\n\n")


# Maximum event size


def test_event_of_exactly_max_event_size_is_accepted(chunks: str) -> None:
    # The limit counts the data buffer plus the line being read: "data: abc" is 9.
    parsed = feed_chunked(b"data: abc\n\n", chunks, max_event_size=9)
    assert datas(parsed) == ["abc"]


@pytest.mark.parametrize(
    ("stream", "limit", "expected"),
    [
        # The data buffer holds each value and its LF: 3 + 3, then "data: 56" (8) is read.
        (b"data: 12\ndata: 34\ndata: 56\n\n", 14, ["12\n34\n56"]),
        # The buffer starts empty again after each event: the second may be as large.
        (b"data: abc\n\ndata: abc\n\n", 9, ["abc", "abc"]),
        (b"data: abc\n\n: a comment\n\ndata: abc\n\n", 11, ["abc", "abc"]),
    ],
)
def test_an_event_at_the_limit_is_accepted_and_one_character_more_is_not(
    chunks: str, stream: bytes, limit: int, expected: list[str]
) -> None:
    # The bound is exact, for every line of an event and every event of a stream: a relay
    # given a limit must not refuse a stream that keeps within it.
    assert datas(feed_chunked(stream, chunks, max_event_size=limit)) == expected
    assert feed_chunked(stream, chunks, max_event_size=limit - 1).error is EventTooLarge


def test_an_error_line_counts_toward_the_limit_as_a_data_line() -> None:
    # A relayed llama.cpp error (``error: {...}``) is read as an event's data, so it is
    # bounded as data is.
    for limit, fits in ((11, True), (10, False)):
        parser = EventParser(max_event_size=limit, error_field=True)
        if fits:
            assert parser.feed(b"error: abc\ndata: x\n\n") == [Event("abc\nx", "error", "")]
        else:
            with pytest.raises(EventTooLarge):
                parser.feed(b"error: abc\ndata: x\n\n")


def test_huge_data_line_raises_event_too_large(chunks: str) -> None:
    parsed = feed_chunked(b"data: " + b"x" * 30 + b"\n\n", chunks, max_event_size=16)
    assert parsed.error is EventTooLarge


def test_line_that_never_ends_raises_event_too_large(chunks: str) -> None:
    parsed = feed_chunked(b": " + b"x" * 30, chunks, max_event_size=16)
    assert parsed.error is EventTooLarge


def test_many_data_lines_raise_event_too_large(chunks: str) -> None:
    parsed = feed_chunked(b"data: 12\n" * 4, chunks, max_event_size=16)
    assert parsed.error is EventTooLarge


def test_size_limit_applies_per_event_not_per_stream(chunks: str) -> None:
    parsed = feed_chunked(b"data: 123456\n\n" * 5, chunks, max_event_size=16)
    assert datas(parsed) == ["123456"] * 5


def test_event_too_large_restores_state_of_the_last_good_feed(chunks: str) -> None:
    for pieces in CHUNKINGS[chunks](b"id: 1\nretry: 5\ndata: a\n\n"):
        parser = EventParser(max_event_size=16)
        for piece in pieces:
            parser.feed(piece)
        with pytest.raises(EventTooLarge, match="max_event_size=16"):
            parser.feed(b"id: 2\nretry: 6\ndata: b\n\ndata: " + b"x" * 20)
        assert (parser.last_event_id, parser.retry, parser.events) == ("1", 5, 1)
        assert parser.closed


def test_max_event_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_event_size"):
        EventParser(max_event_size=0)


# Counters


def test_counters_track_events_and_bytes(chunks: str) -> None:
    stream = b"data: a\n\nid: 1\n\ndata: b\n\n"
    for pieces in CHUNKINGS[chunks](stream):
        parser = EventParser()
        for piece in pieces:
            parser.feed(piece)
        assert (parser.events, parser.bytes_fed) == (2, len(stream))
