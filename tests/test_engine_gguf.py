"""SmolLM2-135M-Instruct from its GGUF on the tiny engine's parts: cache, batching, endings.

One model is loaded for the module (about 10 s and 0.5 GiB); generations are short.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from replystream.engine.base import GenerationRequest, RequestRejected, SamplingParams
from replystream.engine.gguf_engine import load_gguf_model, prompt_format
from replystream.engine.gguf_file import GGUFModel, open_gguf, unpermute_rope_rows
from replystream.engine.kv_cache import ContiguousKVCache, PagedKVCache
from replystream.engine.model import Chunk, TinyModel
from replystream.engine.tiny import TinyEngine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer
from tests.services import require_smollm2

Loaded = tuple[GGUFModel, TinyModel, ByteTokenizer]
QUESTION = ({"role": "user", "content": "What is the capital of France?"},)


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    return load_gguf_model(require_smollm2())


def engine_of(
    loaded: Loaded, model: TinyModel | None = None, *, prefix_caching: bool = False
) -> TinyEngine:
    gguf, base, tokenizer = loaded
    return TinyEngine(
        model or base,
        tokenizer,
        TinyEngineConfig(num_blocks=256, prefix_caching=prefix_caching),
        prompts=prompt_format(gguf, tokenizer),
        stop_tokens=gguf.vocabulary.stop_ids,
        name="smollm2",
    )


async def reply(engine: TinyEngine, messages, max_tokens: int) -> tuple[str, str | None, int]:
    request = GenerationRequest("", SamplingParams(max_tokens=max_tokens, temperature=0), messages)
    text, reason, tokens = "", None, 0
    async for delta in await engine.start(request):
        text, reason, tokens = text + delta.text, delta.finish_reason, tokens + delta.tokens
    return text, reason, tokens


def test_the_file_gives_smollm2s_shape(loaded: Loaded):
    gguf, model, _ = loaded
    c = gguf.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.d_ff, c.context, c.vocab_size, c.rope_theta) == (1536, 8192, 49152, 100000.0)
    assert c.norm_eps == pytest.approx(1e-5)
    # The file names <|im_end|> as its EOS; <|endoftext|> is a known end token of its vocabulary.
    assert gguf.vocabulary.stop_ids == {0, 2}
    assert model.unembed is model.embed  # tied: one matrix, held once
    assert model.parameter_count == 134_515_008


def test_unpermuting_inverts_llama_cpps_rope_row_order():
    heads, half, cols = 3, 4, 5
    hf = np.arange(heads * 2 * half * cols, dtype=np.float32).reshape(heads * 2 * half, cols)
    # llama.cpp's convert_hf_to_gguf.py permute()
    gguf = hf.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(unpermute_rope_rows(gguf, heads), hf)


def test_paged_cache_and_chunked_prefill_give_the_logits_of_one_contiguous_pass(loaded: Loaded):
    _, model, tokenizer = loaded
    c = model.config
    prompt = tokenizer.encode("The history of the printing press begins in the 15th century. " * 9)
    paged = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, 32, 16)
    contiguous = ContiguousKVCache(c.n_layers, c.n_kv_heads, c.head_dim, 256)
    paged.allocator.reserve(0, len(prompt) + 4)
    for start in range(0, len(prompt), 37):  # chunked prefill, chunks across block edges
        last_paged = model.forward([Chunk(0, tuple(prompt[start : start + 37]), start)], paged)
    one_pass = model.prefill(0, prompt, contiguous)
    np.testing.assert_allclose(last_paged[0], one_pass, atol=2e-4)
    token = int(np.argmax(one_pass))
    for step in range(3):
        a = model.decode([Chunk(0, (token,), len(prompt) + step)], paged)[0]
        b = model.decode([Chunk(0, (token,), len(prompt) + step)], contiguous)[0]
        np.testing.assert_allclose(a, b, atol=2e-4)
        token = int(np.argmax(b))


async def test_a_chat_question_is_answered_and_ends_at_its_eos_token(loaded: Loaded):
    engine = engine_of(loaded)
    try:
        text, reason, _ = await reply(engine, QUESTION, 40)
    finally:
        await engine.aclose()
    assert reason == "stop"
    assert "Paris" in text and "<|im_end|>" not in text
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_batched_greedy_replies_equal_replies_made_one_at_a_time(loaded: Loaded):
    questions = [
        ({"role": "user", "content": q},)
        for q in (
            "Name three colours.",
            "What is 2 + 2?",
            "Say hello in French.",
            "Why is the sky blue?",
        )
    ]
    engine = engine_of(loaded)
    try:
        alone = [await reply(engine, q, 12) for q in questions]
        together = await asyncio.gather(*(reply(engine, q, 12) for q in questions))
    finally:
        await engine.aclose()
    assert list(together) == alone
    assert engine.stats().steps < sum(tokens for _, _, tokens in alone) * 2  # they shared steps


async def test_a_chats_next_turn_reuses_its_cached_history_and_makes_the_same_reply(
    loaded: Loaded,
):
    """With prefix caching the second turn's prefill skips the system prompt, the first
    question and the reply the engine made to it (re-rendered by the chat template), and the
    greedy replies are those of an engine without the cache."""
    system = {"role": "system", "content": "You answer in one short sentence. " * 6}
    replies: dict[bool, list[str]] = {}
    hits = 0
    for caching in (False, True):
        engine = engine_of(loaded, prefix_caching=caching)
        messages: tuple[dict[str, str], ...] = (system, *QUESTION)
        try:
            first, _, _ = await reply(engine, messages, 8)
            messages += (
                {"role": "assistant", "content": first},
                {"role": "user", "content": "And of Spain?"},
            )
            second, _, _ = await reply(engine, messages, 8)
            hits = engine.scheduler_stats().prefix_hit_tokens
        finally:
            await engine.aclose()
        replies[caching] = [first, second]
    first_prompt = len(
        prompt_format(loaded[0], loaded[2]).prompt_ids(
            GenerationRequest("", SamplingParams(), (system, *QUESTION))
        )
    )
    assert hits >= first_prompt // 16 * 16 > 0
    assert replies[True] == replies[False]


async def test_a_reply_cut_by_max_tokens_or_the_context_ends_as_length(loaded: Loaded):
    _, model, tokenizer = loaded
    short = copy.copy(model)  # the same weights with a 48-token context
    short.config = dataclasses.replace(model.config, context=48)
    long = ({"role": "user", "content": "Write a long essay about the history of Rome."},)
    prompts = prompt_format(loaded[0], tokenizer)
    prompt_len = len(prompts.prompt_ids(GenerationRequest("", messages=long)))
    engine = engine_of(loaded, short)
    try:
        _, by_tokens, n = await reply(engine, QUESTION, 3)
        assert (by_tokens, n) == ("length", 3)
        _, by_context, made = await reply(engine, long, 500)
        assert (by_context, made) == ("length", 48 - prompt_len)
        too_long = ({"role": "user", "content": "Rome " * 60},)
        with pytest.raises(RequestRejected) as refused:
            await engine.start(GenerationRequest("", messages=too_long))
        assert refused.value.param == "prompt"
    finally:
        await engine.aclose()


def test_emoji_and_cjk_stream_out_whole_and_control_tokens_show_no_text(loaded: Loaded):
    _, _, tokenizer = loaded
    text = "Smile 😀 and 👨‍👩‍👧, 日本語のテキスト,   spaces\n\n\tend"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(i) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces  # some token ended inside a character and was held
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.decode([1, *tokenizer.encode("hi"), 2]) == "hi"


def test_an_empty_prompt_starts_at_bos_or_else_at_a_newline_with_or_without_a_template(
    loaded: Loaded,
):
    gguf, _, tokenizer = loaded
    for bos_id, starts in ((1, [1]), (None, tokenizer.encode("\n"))):
        for template in (gguf.vocabulary.chat_template, None):
            vocabulary = dataclasses.replace(gguf.vocabulary, bos_id=bos_id, chat_template=template)
            prompts = prompt_format(dataclasses.replace(gguf, vocabulary=vocabulary), tokenizer)
            assert prompts.prompt_ids(GenerationRequest("")) == starts, (bos_id, template)


def test_a_file_that_is_not_a_llama_gguf_is_refused_naming_it(tmp_path: Path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        open_gguf(bad)


def forcing(model: TinyModel, token: int, at_step: int) -> TinyModel:
    """The same model, but at its ``at_step``-th forward pass ``token`` is every row's
    likeliest: as if the model chose to end there with that token."""
    forced = copy.copy(model)
    steps = 0

    def forward(chunks, cache, rows=None):
        nonlocal steps
        logits = model.forward(chunks, cache, rows)
        steps += 1
        if steps == at_step:
            logits[:, token] = logits.max(axis=1) + 1.0
        return logits

    forced.forward = forward  # type: ignore[method-assign]
    return forced


async def test_a_reply_ending_on_endoftext_finishes_stop_without_showing_it(loaded: Loaded):
    """SmolLM2's file names only <|im_end|> as its EOS; the model also ends text with
    <|endoftext|> (id 0), which must end the reply as ``stop`` rather than run on to
    ``max_tokens``; it is not shown and has no log probability."""
    gguf, model, _ = loaded
    endoftext = gguf.vocabulary.tokens.index("<|endoftext|>")
    engine = engine_of(loaded, forcing(model, endoftext, at_step=3))
    plain = engine_of(loaded)
    request = GenerationRequest(
        "", SamplingParams(max_tokens=8, temperature=0, logprobs=1), QUESTION
    )
    try:
        deltas = [d async for d in await engine.start(request)]
        unforced = [d async for d in await plain.start(request)]
    finally:
        await engine.aclose()
        await plain.aclose()
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert sum(d.tokens for d in deltas) == 3
    # What came before the end token is the model's own reply; the end token adds nothing.
    assert "".join(d.text for d in deltas) == "".join(d.text for d in unforced[:2])
    assert deltas[-1].text == "" and deltas[-1].logprobs == ()
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_a_final_assistant_message_is_continued_not_answered_again(loaded: Loaded):
    """``continue_final_message`` over the server: the model goes on from the assistant's
    words; it does not close that turn and start a new answer. ``add_generation_prompt:
    false`` leaves the assistant's turn unopened, so the prompt is that many tokens shorter."""
    from replystream.server import create_app, running
    from tests.sse_client import post_events

    engine = engine_of(loaded)
    started = {"role": "assistant", "content": "The capital of France is"}
    base = {"max_tokens": 1, "temperature": 0, "stream": False}
    try:
        async with running(create_app(engine)) as url:
            got = await post_events(
                f"{url}/v1/chat/completions",
                {**base, "messages": [*QUESTION, started], "continue_final_message": True},
            )
            usual, without = [
                await post_events(
                    f"{url}/v1/chat/completions", {**base, "messages": list(QUESTION), **extra}
                )
                for extra in ({}, {"add_generation_prompt": False})
            ]
    finally:
        await engine.aclose()
    assert got.status == 200
    assert json.loads(got.raw)["choices"][0]["message"]["content"] == " Paris"
    read = [json.loads(r.raw)["usage"]["prompt_tokens"] for r in (usual, without)]
    opening = len(loaded[2].encode("<|im_start|>assistant\n"))
    assert read[1] == read[0] - opening
