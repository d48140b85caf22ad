"""A GGUF's tokenizer metadata as llama.cpp reads it: ``tokenizer.ggml.add_bos_token`` (every
prompt begins with BOS when the file says so, LLaMA 3's pre-tokenizers by default, never
twice), and a missing ``tokenizer.ggml.pre`` (read with a warning)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from replystream.engine.base import GenerationRequest
from replystream.engine.gguf_engine import load_gguf_model, prompt_format
from tests.gguf_files import write_llama_gguf

BOS = 257  # write_llama_gguf's


@pytest.mark.parametrize(
    ("pre", "add_bos", "begins_with_bos"),
    [
        ("llama-bpe", None, True),  # LLaMA 3's default
        ("llama-bpe", False, False),
        ("gpt2", None, False),
        ("gpt2", True, True),
    ],
)
def test_a_plain_prompt_begins_with_bos_when_the_file_says_so(
    tmp_path: Path, pre: str, add_bos: bool | None, begins_with_bos: bool
) -> None:
    meta = {"pre": pre, "tokenizer.ggml.add_bos_token": add_bos}
    gguf, _, tokenizer = load_gguf_model(write_llama_gguf(tmp_path / "m.gguf", meta=meta))
    ids = prompt_format(gguf, tokenizer).prompt_ids(GenerationRequest("hi"))
    assert ids[1:] == tokenizer.encode("hi") if begins_with_bos else ids == tokenizer.encode("hi")
    assert (ids[0] == BOS) is begins_with_bos


def test_a_template_that_writes_bos_gets_one(tmp_path: Path) -> None:
    # (This vocabulary's BOS is ChatML's ``<|im_start|>``, as SmolLM2's is: a template of
    # the messages' text alone.)
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    meta = {"pre": "llama-bpe", "tokenizer.chat_template": template}
    gguf, _, tokenizer = load_gguf_model(write_llama_gguf(tmp_path / "m.gguf", meta=meta))
    chat = GenerationRequest(messages=({"role": "user", "content": "hi"},))
    ids = prompt_format(gguf, tokenizer).prompt_ids(chat)
    assert ids[0] == BOS and ids[1] != BOS


@pytest.mark.parametrize(
    ("meta", "said"),
    [
        ({"tokenizer.ggml.add_bos_token": "yes"}, "add_bos_token is not true or false"),
        (
            {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None},
            "add_bos_token asks for a BOS the file does not name",
        ),
    ],
    ids=["not-a-bool", "no-bos"],
)
def test_an_add_bos_token_that_cannot_be_honoured_is_refused(
    tmp_path: Path, meta: dict[str, object], said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        load_gguf_model(write_llama_gguf(tmp_path / "m.gguf", meta=meta))


def test_a_file_naming_no_pre_tokenizer_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_llama_gguf(tmp_path / "m.gguf", meta={"pre": None})
    with caplog.at_level(logging.WARNING, logger="replystream.engine"):
        load_gguf_model(path)
    [warned] = [r.getMessage() for r in caplog.records if "tokenizer.ggml.pre" in r.getMessage()]
    assert warned.startswith(f"{path}: no tokenizer.ggml.pre: its text is split as GPT-2")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="replystream.engine"):
        load_gguf_model(write_llama_gguf(tmp_path / "named.gguf", meta={"pre": "gpt2"}))
    assert not caplog.records
