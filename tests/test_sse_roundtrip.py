"""Property: whatever `encode` writes, `EventParser` reads back, however the bytes are cut."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.sse import Event, EventParser, encode, encode_comment

# A field value cannot hold CR or LF (they end the line), and an id holding NUL is ignored.
field_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n\0"))

events = st.builds(
    Event,
    data=st.text(),  # CR allowed: it is expected back as LF
    type=field_text.filter(bool),
    id=st.none() | field_text,
    retry=st.none() | st.integers(min_value=0, max_value=2**63),
)
comments = st.text(st.characters(codec="utf-8", exclude_characters="\r\n")).map(encode_comment)


def expected_events(sent: list[Event]) -> list[Event]:
    """What a parser must dispatch: data with CR read as LF, the id in force, no retry."""
    last_id = ""
    out = []
    for event in sent:
        if event.id is not None:
            last_id = event.id
        data = event.data.replace("\r\n", "\n").replace("\r", "\n")
        out.append(Event(data, event.type, last_id))
    return out


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(events | comments, max_size=12),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
def test_encoded_events_parse_back_under_any_chunking(
    items: list[Event | bytes], cuts: list[int]
) -> None:
    sent = [item for item in items if isinstance(item, Event)]
    body = b"".join(item if isinstance(item, bytes) else encode(item) for item in items)
    points = sorted({cut % (len(body) + 1) for cut in cuts})
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]

    parser = EventParser()
    received = [event for piece in pieces for event in parser.feed(piece)]
    assert parser.at_boundary
    parser.close()

    expected = expected_events(sent)
    assert received == expected
    assert parser.last_event_id == (expected[-1].id if expected else "")
    retries = [event.retry for event in sent if event.retry is not None]
    assert parser.retry == (retries[-1] if retries else None)
    assert not parser.discarded_incomplete
    assert parser.events == len(sent)
    assert parser.bytes_fed == len(body)
