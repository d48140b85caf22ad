"""An upstream's embeddings answer read in slices (``engine.embeddings_answer``): whatever
the text, the same verdict and the same answer as a full parse would give, and the event
loop turning while a large one is read."""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import from_json

from replystream.engine import embeddings_answer
from replystream.engine.embeddings_answer import checked_answer
from tests.loop_turns import counted_turns

# Text that a structural scan could stumble on: quotes, backslashes, brackets, a key's name.
TRICKY = st.text(st.sampled_from(['"', "\\", "[", "]", "{", "}", ",", ":", "a", "é", "\n"]))
TEXT = st.one_of(st.text(max_size=8), TRICKY.map(lambda t: t[:8]), st.just("data"))
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
VALUE = st.recursive(
    SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)
FLOATS = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=6)
EMBEDDING = st.one_of(
    FLOATS,
    FLOATS.map(lambda v: base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()),
)
ITEM = st.fixed_dictionaries(
    {"embedding": EMBEDDING}, optional={"object": st.just("embedding"), "index": st.integers(0, 9)}
).flatmap(lambda item: st.dictionaries(TEXT, VALUE, max_size=2).map(lambda more: {**more, **item}))
USAGE = st.one_of(
    st.fixed_dictionaries({"prompt_tokens": st.integers(-1, 10**6), "total_tokens": SCALAR}),
    VALUE,
)
ANSWER = st.fixed_dictionaries(
    {"data": st.lists(ITEM, max_size=4)},
    optional={"object": st.just("list"), "model": TEXT, "usage": USAGE, "id": TEXT},
).flatmap(
    lambda answer: st.dictionaries(TEXT, VALUE, max_size=2).map(lambda more: {**more, **answer})
)


@st.composite
def written(draw: st.DrawFn, value: Any) -> bytes:
    """``value`` as JSON, spaced and escaped one of the ways a server may write it."""
    indent = draw(st.sampled_from([None, 1, "\t"]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\r\n", " :  ")]))
    ascii_only = draw(st.booleans())
    text = json.dumps(value, indent=indent, separators=separators, ensure_ascii=ascii_only)
    return text.encode()


def embedding_read(embedding: object) -> bool:
    """Whether a client reads ``embedding`` as OpenAI's SDK does: a list of finite numbers,
    or base64 NumPy reads as float32s."""
    if isinstance(embedding, list):
        try:
            return all(type(x) in (int, float) and math.isfinite(x) for x in embedding)
        except OverflowError:  # an integer past any float
            return False
    if isinstance(embedding, str):
        try:
            return len(base64.b64decode(embedding, validate=True)) % 4 == 0
        except ValueError:
            return False
    return False


def reference(raw: bytes, answer_as: str) -> tuple[Any, int | None] | None:
    """What a full parse says: the answer renamed and its prompt tokens, or None."""
    try:
        answer = from_json(raw)
    except ValueError:
        return None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or not all(
        isinstance(item, dict) and embedding_read(item.get("embedding")) for item in data
    ):
        return None
    usage = answer.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return {**answer, "model": answer_as}, tokens if type(tokens) is int and tokens >= 0 else None


async def verdict(raw: bytes) -> tuple[Any, int | None] | None:
    got = await checked_answer(raw, "asked")
    return None if got is None else (from_json(got.body), got.prompt_tokens)


@settings(max_examples=300, deadline=None)
@given(st.data())
async def test_an_answer_reads_as_a_full_parse_reads_it(data: st.DataObject) -> None:
    raw = data.draw(written(data.draw(ANSWER)))
    expected = reference(raw, "asked")
    assert expected is not None
    assert await verdict(raw) == expected


@settings(max_examples=500, deadline=None)
@given(st.data())
async def test_a_broken_or_other_text_gets_the_full_parses_verdict(data: st.DataObject) -> None:
    """Answers cut anywhere, a byte replaced or added anywhere, and other JSON values."""
    value = data.draw(st.one_of(ANSWER, VALUE, st.fixed_dictionaries({"data": VALUE})))
    raw = data.draw(written(value))
    change = data.draw(st.sampled_from(["none", "cut", "replace", "insert"]))
    at = data.draw(st.integers(0, len(raw)))
    byte = data.draw(st.sampled_from(list(b'"[]{},:\\ 0an')))
    if change == "cut":
        raw = raw[:at]
    elif change == "replace" and at < len(raw):
        raw = raw[:at] + bytes([byte]) + raw[at + 1 :]
    elif change == "insert":
        raw = raw[:at] + bytes([byte]) + raw[at:]
    assert await verdict(raw) == reference(raw, "asked")


@pytest.mark.parametrize(
    "listed",
    [
        b'{"embedding": []} 5, {"embedding": []}',
        b'{"embedding": []},, {"embedding": []}',
        b'{"embedding": []} {"embedding": []}',
        b'1, {"embedding": []}',
        b'{"embedding": []}, 1',
        b'{"embedding": []},',
        b" , ",
        b"null",
        b'{"embedding": []}]',
        b'{"embedding": [}',
    ],
)
async def test_what_lies_between_the_items_is_checked_too(listed: bytes) -> None:
    raw = b'{"data": [' + listed + b'], "model": "m"}'
    assert reference(raw, "asked") is None
    assert await checked_answer(raw, "asked") is None


async def test_the_data_goes_on_byte_for_byte_and_the_rest_is_renamed() -> None:
    data = b'[ {"embedding": [0.10000000149011612, -2E-5], "index": 0} ]'
    raw = b'{"object": "list", "data": ' + data + b', "model": "m", "usage": {"prompt_tokens": 3}}'
    got = await checked_answer(raw, "alias")
    assert got is not None and got.prompt_tokens == 3
    assert got.body == (
        b'{"object":"list","data":' + data + b',"model":"alias","usage":{"prompt_tokens":3}}'
    )
    named_last = await checked_answer(b'{"data": []}', "alias")
    assert named_last is not None and named_last.body == b'{"data":[],"model":"alias"}'


async def test_the_loop_turns_while_a_large_answer_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embeddings_answer, "SLICE_BYTES", 1024)
    items = [{"embedding": [0.5] * 200, "index": i} for i in range(40)]  # about 40 KB
    raw = json.dumps({"data": items, "model": "m"}).encode()
    async with counted_turns() as turns:
        got = await checked_answer(raw, "asked")
        assert turns() >= 40, turns()  # one at least every kilobyte scanned, and every item parsed
    assert got is not None and from_json(got.body)["data"] == items
