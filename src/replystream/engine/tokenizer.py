"""Byte-level BPE: text to token ids, and token ids back to text as soon as it is valid UTF-8.

This file decides how token ids become bytes and when bytes become text. Encoding uses the
trained ``tokenizer.json`` through Hugging Face ``tokenizers``; decoding does not: each id maps
to the bytes it stands for (byte-level BPE spells bytes as printable characters, GPT-2's
``bytes_to_unicode`` table), and an incremental UTF-8 decoder holds a token that ends inside a
multi-byte character until the character is complete. It must not know about models, sampling
or requests.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from tokenizers import Tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte to printable-character table, as used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


class ByteTokenizer:
    """Encodes text to ids with a trained byte-level BPE; maps each id to its raw bytes."""

    def __init__(self, path: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(path))
        vocab: dict[str, int] = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
        to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        self._bytes: list[bytes] = [b""] * len(vocab)
        for piece, token_id in vocab.items():
            self._bytes[token_id] = bytes(to_byte[char] for char in piece)

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def decode(self, ids: list[int]) -> str:
        """All of ``ids`` as text (invalid UTF-8 becomes U+FFFD)."""
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Token ids in, text out as soon as it is valid UTF-8; split characters are held back."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes (empty while a character is still open)."""
        return str(self._decoder.decode(self._tokenizer.token_bytes(token_id)))

    def flush(self) -> str:
        """Whatever is held at the end of a reply (an unfinished character becomes U+FFFD)."""
        return str(self._decoder.decode(b"", final=True))

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held."""
        held, _ = self._decoder.getstate()
        return bool(held)
