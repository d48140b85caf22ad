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
from collections.abc import Iterable, Sequence
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
    """Encodes text to ids with a trained byte-level BPE; maps each id to its raw bytes.

    Control tokens (``<|im_end|>`` and the like) are matched whole by ``encode`` (a chat
    template's markup) and not by ``encode_text`` (a message's text, where ``<|im_end|>`` is
    ten characters), and ``hidden``: they decode to no text, as ``skip_special_tokens`` does,
    though log probabilities name them as the vocabulary spells them (``spelt_bytes``).
    """

    def __init__(self, path: Path) -> None:
        vocab: dict[str, int] = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
        pieces = [""] * len(vocab)
        for piece, token_id in vocab.items():
            pieces[token_id] = piece
        self._setup(Tokenizer.from_file(str(path)), pieces, ())

    @classmethod
    def from_pieces(
        cls, tokenizer: Tokenizer, pieces: Sequence[str], hidden: Iterable[int]
    ) -> ByteTokenizer:
        """A tokenizer built elsewhere (a GGUF's vocabulary), with each id's byte spelling."""
        self = cls.__new__(cls)
        self._setup(tokenizer, pieces, hidden)
        return self

    def _setup(self, tokenizer: Tokenizer, pieces: Sequence[str], hidden: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        # A copy that reads control spellings as text; the flag is not toggled on the one
        # tokenizer, since another thread may be encoding with it (0.1 s at load for SmolLM2).
        self._text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True
        self.control_ids: dict[str, int] = {
            token.content: token_id
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        # A piece spelled outside the byte alphabet (an added token in some GGUFs) is its text.
        self._bytes: list[bytes] = [
            bytes(to_byte[c] for c in piece) if set(piece) <= to_byte.keys() else piece.encode()
            for piece in pieces
        ]
        # Control tokens' spellings, for log probabilities; their text is nothing.
        self._spelt = {token_id: self._bytes[token_id] for token_id in hidden}
        self.hidden_ids = frozenset(self._spelt)
        for token_id in self.hidden_ids:
            self._bytes[token_id] = b""

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, control tokens' spellings matched whole."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str, at_start: bool = True) -> list[int]:
        """Ids of ``text``, control tokens' spellings as the plain characters they are
        (wherever the text stands: byte-level BPE marks no start of its input)."""
        return list(self._text_tokenizer.encode(text, add_special_tokens=False).ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the text (none for a control token)."""
        return self._bytes[token_id]

    def spelt_bytes(self, token_id: int) -> bytes:
        """The token as the vocabulary spells it, a control token's spelling included: what log
        probabilities name it (``<|im_end|>``, as vLLM and llama.cpp's server do)."""
        return self._spelt.get(token_id, self._bytes[token_id])

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
