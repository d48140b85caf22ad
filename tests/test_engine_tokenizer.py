"""Byte-level BPE round trips and the incremental detokenizer holding split characters."""

from __future__ import annotations

import pytest

from replystream.engine.tiny import ASSETS
from replystream.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, bytes_to_unicode


@pytest.fixture(scope="module")
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer(ASSETS / "tokenizer.json")


def test_byte_table_covers_every_byte_once() -> None:
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256


@pytest.mark.parametrize("text", ["And God said", "naïve café", "日本語の文", "🙂👋🏽 ok", ""])
def test_encode_then_decode_is_the_identity(tokenizer: ByteTokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def stream(tokenizer: ByteTokenizer, text: str) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in tokenizer.encode(text)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", ["say 👋🏽 to 世界", "🙂🙂 and 中文字符"])
def test_split_characters_are_held_until_complete(tokenizer: ByteTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    # The corpus has no emoji or CJK, so these characters span several byte tokens.
    assert any(not tokenizer.token_bytes(i).decode("utf-8", "ignore") for i in ids)
    pieces = stream(tokenizer, text)
    assert "".join(pieces) == text
    assert "" in pieces  # a token ending inside a character yields no text yet
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_emoji_appears_whole_on_its_last_byte(tokenizer: ByteTokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("🙂")
    assert len(ids) == 4
    assert [detok.push(i) for i in ids] == ["", "", "", "🙂"]
    assert not detok.pending


def test_an_unfinished_character_at_the_end_becomes_a_replacement(
    tokenizer: ByteTokenizer,
) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("a世")
    assert "".join(detok.push(i) for i in ids[:-1]) == "a"
    assert detok.pending
    assert detok.flush() == "\ufffd"
