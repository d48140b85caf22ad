"""A streamed OpenAI text chunk is made from a per-reply template: it must be, byte for byte,
the chunk encoded whole, whatever the text, the model name, the reply id, the dialect or the
choice's index (``n > 1``)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from replystream.delivery.formats import Usage, json_compact
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


ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=())) | st.sampled_from(
    ["\x7f", "a\x7fb", "\ud800", "é😀\x00"]
)


@given(
    model=ANY_TEXT,
    reply_id=ANY_TEXT,
    finish_reason=ANY_TEXT.filter(lambda reason: reason != "tool_calls"),
    kind=st.sampled_from(["chat", "text"]),
    index=st.integers(0, 127),
    tokens=st.integers(0, 2**40),
)
def test_the_role_finish_and_usage_chunks_are_what_json_dumps_writes(
    model, reply_id, finish_reason, kind, index, tokens
):
    fmt = OpenAIStreamFormat(kind, model, 1700000000, True, index)
    chunks = [*fmt.started(reply_id), *fmt.finished(finish_reason, Usage(tokens, 1))]
    head = {
        "id": completion_id(kind, reply_id),
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": 1700000000,
        "model": model,
    }
    if kind == "chat":
        role = {"role": "assistant", "content": ""}
        first = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
        last = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
    else:
        first = {"index": index, "text": "", "logprobs": None, "finish_reason": None}
        last = {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}
    usage = {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}
    expected = [
        {**head, "choices": [first], "usage": None},
        {**head, "choices": [last], "usage": None},
        {**head, "choices": [], "usage": usage},
    ]
    assert [data for _, data in chunks] == [
        *(json.dumps(chunk, separators=(",", ":")) for chunk in expected),
        "[DONE]",
    ]


@given(value=ANY_TEXT, number=st.integers(-(2**80), 2**80))
def test_json_compact_writes_what_json_dumps_writes(value, number):
    payload = {value: [value, number, True, False, None, {"k": {}}, []]}
    assert json_compact(payload) == json.dumps(payload, separators=(",", ":"))


def test_json_compact_escapes_del_and_writes_a_lone_surrogate_as_json_dumps_does():
    assert json_compact({"m": "a\x7f\ud800"}) == '{"m":"a\\u007f\\ud800"}'
