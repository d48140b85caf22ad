"""The SSE transport's direct spelling of a log entry is the encoder's, byte for byte."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from replystream.delivery.replay import LogEntry
from replystream.server.sse_transport import sse_event
from replystream.sse import encode_data

# Text that has a UTF-8 form (a lone surrogate has none: the encoder refuses it).
DATA = st.text(alphabet=st.characters(exclude_categories=["Cs"]))
EVENT = st.one_of(
    st.none(), st.just("message"), st.from_regex(r"[a-z][a-z_.]{0,20}", fullmatch=True)
)


@given(
    seq=st.integers(min_value=1, max_value=10**9), event=EVENT, data=DATA, numbered=st.booleans()
)
def test_sse_event_writes_what_the_encoder_writes(
    seq: int, event: str | None, data: str, numbered: bool
) -> None:
    expected = encode_data(data, type=event, id=str(seq) if numbered else None)
    assert sse_event(LogEntry(seq, event, data), numbered) == expected


def test_a_chat_chunk_is_its_id_and_one_data_line() -> None:
    chunk = '{"choices":[{"index":0,"delta":{"content":" hi"}}]}'
    assert sse_event(LogEntry(7, None, chunk), True) == b"id: 7\ndata: " + chunk.encode() + b"\n\n"
