"""Byte-exact expectations for the event-stream encoder."""

from __future__ import annotations

import pytest

from replystream.sse import Event, SSEError, encode, encode_comment, encode_data


def test_data_only_event_is_one_data_line_and_a_blank_line() -> None:
    assert encode(Event('"A "')) == b'data: "A "\n\n'


def test_empty_data_is_one_empty_data_line() -> None:
    assert encode(Event("")) == b"data: \n\n"


def test_multiline_data_writes_one_data_line_per_line() -> None:
    assert encode(Event("a\nb\nc")) == b"data: a\ndata: b\ndata: c\n\n"


def test_empty_lines_in_data_are_kept() -> None:
    assert encode(Event("\na\n\n")) == b"data: \ndata: a\ndata: \ndata: \n\n"


def test_cr_and_crlf_in_data_end_lines_like_lf() -> None:
    assert encode(Event("a\r\nb\rc\n\rd")) == (b"data: a\ndata: b\ndata: c\ndata: \ndata: d\n\n")


def test_leading_space_in_a_value_survives_the_one_space_separator() -> None:
    assert encode(Event(" x", type=" t", id=" 1")) == b"event:  t\nid:  1\ndata:  x\n\n"


def test_output_is_utf8() -> None:
    assert encode(Event("héllo €😀", type="ünï")) == "event: ünï\ndata: héllo €😀\n\n".encode()


def test_nul_in_data_is_written_as_is() -> None:
    assert encode(Event("a\0b")) == b"data: a\0b\n\n"


def test_message_type_is_omitted() -> None:
    assert encode(Event("x", type="message")) == b"data: x\n\n"


def test_other_type_is_written_as_event_field() -> None:
    assert encode(Event("x", type="token")) == b"event: token\ndata: x\n\n"


def test_id_is_written_when_not_none() -> None:
    assert encode(Event("x", id="17")) == b"id: 17\ndata: x\n\n"


def test_empty_id_is_written_as_id_colon_space() -> None:
    # The parser strips the one space and reads "", which resets the last event ID.
    assert encode(Event("x", id="")) == b"id: \ndata: x\n\n"


def test_retry_is_written_when_not_none() -> None:
    assert encode(Event("x", retry=3000)) == b"retry: 3000\ndata: x\n\n"
    assert encode(Event("x", retry=0)) == b"retry: 0\ndata: x\n\n"


def test_field_order_is_event_id_retry_data() -> None:
    event = Event("a\nb", type="t", id="9", retry=5)
    assert encode(event) == b"event: t\nid: 9\nretry: 5\ndata: a\ndata: b\n\n"


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\r\nb", "\n", "a\0b"])
def test_id_with_cr_lf_or_nul_is_refused(bad: str) -> None:
    with pytest.raises(SSEError, match="id"):
        encode(Event("x", id=bad))


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\r\nb", "\r", "a\0b"])
def test_type_with_cr_lf_or_nul_is_refused(bad: str) -> None:
    with pytest.raises(SSEError, match="type"):
        encode(Event("x", type=bad))


def test_empty_type_is_refused_because_it_reads_back_as_message() -> None:
    with pytest.raises(SSEError, match="type"):
        encode(Event("x", type=""))


def test_negative_retry_is_refused() -> None:
    with pytest.raises(SSEError, match="retry"):
        encode(Event("x", retry=-1))


def test_bool_retry_is_refused() -> None:
    with pytest.raises(SSEError, match="retry"):
        encode(Event("x", retry=True))


def test_lone_surrogate_is_refused() -> None:
    with pytest.raises(SSEError, match="UTF-8"):
        encode(Event("\udc80"))


def test_sse_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        encode(Event("x", id="\n"))


def test_comment_is_colon_space_text_and_a_blank_line() -> None:
    assert encode_comment("keep-alive") == b": keep-alive\n\n"


def test_empty_comment() -> None:
    assert encode_comment() == b": \n\n"


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "\r\n"])
def test_comment_with_cr_or_lf_is_refused(bad: str) -> None:
    with pytest.raises(SSEError, match="comment"):
        encode_comment(bad)


@pytest.mark.parametrize(
    "event",
    [
        Event("x"),
        Event(""),
        Event("a\r\nb", type="t"),
        Event("x", type="message", id=""),
        Event("x", id="42"),
        Event("é", type="ü", id="ñ"),
    ],
)
def test_encode_data_writes_the_same_bytes_as_encode(event: Event) -> None:
    assert encode_data(event.data, type=event.type, id=event.id) == encode(event)


def test_encode_data_without_type_writes_a_message() -> None:
    assert encode_data("x") == b"data: x\n\n"


@pytest.mark.parametrize(("type_", "id_"), [("a\nb", None), ("", None), (None, "a\0b")])
def test_encode_data_refuses_what_encode_refuses(type_: str | None, id_: str | None) -> None:
    with pytest.raises(SSEError):
        encode_data("x", type=type_, id=id_)
