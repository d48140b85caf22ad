"""A streamed OpenAI text chunk is made from a per-reply template: it must be, byte for byte,
the chunk encoded whole, whatever the text, the model name, the reply id, the dialect or the
choice's index (``n > 1``)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from replystream.delivery.openai_formats import OpenAIStreamFormat, completion_id

PLACEHOLDER_LIKE = st.sampled_from(["\x00text\x00", '"\\', "é😀", ""])


@given(
    text=st.text() | PLACEHOLDER_LIKE,
    model=st.text() | PLACEHOLDER_LIKE,
    reply_id=st.text() | PLACEHOLDER_LIKE,
    kind=st.sampled_from(["chat", "text"]),
    include_usage=st.booleans(),
    index=st.integers(0, 127),
)
def test_a_text_chunk_is_the_bytes_of_the_whole_chunk_encoded(
    text, model, reply_id, kind, include_usage, index
):
    fmt = OpenAIStreamFormat(kind, model, 1700000000, include_usage, index, index > 0)
    fmt.started(reply_id)
    fmt.text("warm the template", 1)
    [(event, data)] = fmt.text(text, 1)
    choice: dict[str, object]
    if kind == "chat":
        delta = {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    whole: dict[str, object] = {
        "id": completion_id(kind, reply_id),
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": 1700000000,
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        whole["usage"] = None
    assert event is None
    assert data == json.dumps(whole, separators=(",", ":"))


def test_a_new_reply_id_makes_a_new_template():
    fmt = OpenAIStreamFormat("chat", "m", 1)
    fmt.started("first")
    assert "chatcmpl-first" in fmt.text("a", 1)[0][1]
    fmt.started("second")
    assert "chatcmpl-second" in fmt.text("a", 1)[0][1]
