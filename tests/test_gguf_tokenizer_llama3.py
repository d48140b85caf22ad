"""LLaMA 3's byte-level BPE takes a pre-tokenized word the vocabulary holds whole, as one
token, before any merge (``ignore_merges``: its ``tokenizer.json`` says so, and llama.cpp
sets it for the ``llama-bpe`` pre-tokenizer); GPT-2's builds every token from merges."""

from __future__ import annotations

from pathlib import Path

import pytest

from replystream.engine.gguf_engine import load_gguf_model
from tests.gguf_files import TOKENS, write_llama_gguf

# "Ġtt" (" tt") is a token no merge makes.
WHOLE = [*TOKENS[:259], "Ġtt"]


@pytest.mark.parametrize(
    ("pre", "ids"),
    [
        ("llama-bpe", [259]),
        ("llama3", [259]),
        ("gpt2", [TOKENS.index("Ġ"), TOKENS.index("t"), TOKENS.index("t")]),
    ],
)
def test_a_word_the_vocabulary_holds_is_one_token_under_llama3s_split_only(
    tmp_path: Path, pre: str, ids: list[int]
) -> None:
    path = write_llama_gguf(tmp_path / "m.gguf", meta={"tokens": WHOLE, "merges": [], "pre": pre})
    _, _, tokenizer = load_gguf_model(path)
    assert tokenizer.encode(" tt") == ids
