"""Log probabilities in streams: each chunk carries exactly its tokens', whatever is withheld
(hold-back, stop strings) or batched; streamed equal whole; the built-in model's are its own
log-softmax; the relay passes the upstream's through. Pure pipeline first, then real servers
with the official openai SDK."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.delivery.openai_formats import (
    OpenAIStreamFormat,
    TextOffsets,
    completion_logprobs,
)
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Delta, DeltaStream, GenerationRequest, TokenLogprob, TopLogprob
from replystream.engine.tiny import load_default_engine
from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.processes import replica
from tests.scripted_engine import ScriptedEngine, detokenize
from tests.sse_client import post_events

ALPHABET = "ab \n"


def made(index: int, text: str) -> TokenLogprob:
    return TokenLogprob(text, -float(index), text.encode())


@st.composite
def tokens_and_stops(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    text = draw(st.text(alphabet=ALPHABET, max_size=30))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 2)))
    tokens = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    stops = draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3))
    return tokens, stops


@settings(max_examples=300, deadline=None)
@given(tokens_and_stops(), st.integers(0, 3), st.integers(1, 3))
def test_each_chunk_carries_exactly_its_tokens_logprobs_in_order(
    case: tuple[list[str], list[str]], window: int, batch: int
) -> None:
    tokens, stops = case
    policy = DeliveryPolicy(holdback_tokens=window, batch_tokens=batch)
    pipeline = ReplyPipeline(
        OpenAIStreamFormat("chat", "m", 0), policy, stops=tuple(stops), logprobs=True
    )
    entries = pipeline.start("r")
    pushed = [made(i, t) for i, t in enumerate(tokens)]
    for token in pushed:
        entries += pipeline.push(Delta(token.token, 1, 0.0, logprobs=(token,)), 0.0)
        if pipeline.halted:
            break
    entries += pipeline.finish()
    sent: list[float] = []
    for entry in entries:
        if entry.data == "[DONE]":
            continue
        choice = json.loads(entry.data)["choices"][0]
        content = choice["delta"].get("content")
        if content is None or choice["finish_reason"] is not None or choice["delta"].get("role"):
            assert choice["logprobs"] is None  # the role and finish chunks carry no tokens
            continue
        sent += [item["logprob"] for item in choice["logprobs"]["content"]]
    # The tokens whose text was shown, in order, each once: a prefix of what was made.
    assert sent == [e.logprob for e in pushed[: len(sent)]]
    if not pipeline.halted:
        assert len(sent) == len(tokens)


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


CHAT: dict[str, Any] = {
    "model": "simulated",
    "messages": [{"role": "user", "content": "count"}],
    "seed": 5,
    "logprobs": True,
    "top_logprobs": 3,
    "stop": ["ee fo"],  # cuts inside "three ": its token goes with the text "thr"
    "extra_body": {"batch_tokens": 2, "holdback_tokens": 1},
}


def chat_entries(logprobs: Any) -> list[tuple[str, float, list[int], list[tuple[str, float]]]]:
    return [
        (e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in logprobs.content
    ]


async def test_chat_logprobs_streamed_equal_the_whole_ones_token_for_token():
    engine = fast_engine(reply_text="one two three four five six")
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.chat.completions.create(**CHAT)
        chunks = [c async for c in await client.chat.completions.create(**CHAT, stream=True)]
        plain = await client.chat.completions.create(
            **{k: v for k, v in CHAT.items() if k not in ("logprobs", "top_logprobs")}
        )
    assert whole.choices[0].logprobs is not None
    expected = chat_entries(whole.choices[0].logprobs)
    streamed = []
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        if lp is not None:
            assert lp.content is not None
            streamed += chat_entries(lp)
    assert streamed == expected
    assert [token for token, *_ in expected] == ["one ", "two ", "three "]
    assert all(len(top) == 3 and top[0][0] == token for token, _, _, top in expected)
    assert all(bytes(raw).decode() == token for token, _, raw, _ in expected)
    assert plain.choices[0].logprobs is None


async def test_legacy_completion_logprobs_have_openais_shape_streamed_and_whole():
    ask: dict[str, Any] = {"model": "simulated", "prompt": "x", "max_tokens": 4, "logprobs": 2}
    # text_offset: places in the prompt and the completion, the first after the prompt.
    engine = fast_engine(reply_text="alpha beta gamma delta")
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.completions.create(**ask)
        chunks = [c async for c in await client.completions.create(**ask, stream=True)]
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens == ["alpha ", "beta ", "gamma ", "delta "]
    assert lp.text_offset == [1, 7, 12, 18]
    assert lp.top_logprobs is not None and all(len(top) == 2 for top in lp.top_logprobs)
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    for chunk in chunks:
        piece = chunk.choices[0].logprobs
        if piece is not None and piece.tokens:
            tokens += piece.tokens
            offsets += piece.text_offset or []
            values += piece.token_logprobs or []
    assert (tokens, offsets, values) == (lp.tokens, lp.text_offset, lp.token_logprobs)


async def test_the_tiny_models_logprobs_are_its_own_distribution_streamed_and_whole():
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "And the LORD said unto Moses,"}],
        "temperature": 0,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 5,
    }
    async with running(create_app(load_default_engine())) as url, sdk(url) as client:
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    assert whole.choices[0].logprobs is not None
    expected = chat_entries(whole.choices[0].logprobs)
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chat_entries(chunk.choices[0].logprobs)
    ]
    assert streamed == expected and len(expected) == 12
    shown = b"".join(bytes(raw) for _, _, raw, _ in expected).decode("utf-8", "replace")
    assert shown == whole.choices[0].message.content  # the bytes are exactly the text's
    for token, logprob, _, top in expected:
        values = [value for _, value in top]
        # Greedy: the made token is the model's likeliest, and the five are a distribution's.
        assert top[0] == (token, logprob) and values == sorted(values, reverse=True)
        assert logprob <= 0 and sum(math.exp(v) for v in values) <= 1 + 1e-9


async def test_the_tiny_models_partial_character_token_is_named_by_its_escaped_bytes():
    # Its byte-level vocabulary's token 172 is the byte f0 alone (an emoji's first): forced.
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "And the LORD said unto Moses,"}],
        "temperature": 0,
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "logit_bias": {"172": 100},
    }
    async with running(create_app(load_default_engine())) as url, sdk(url) as client:
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    assert whole.choices[0].logprobs is not None
    made = chat_entries(whole.choices[0].logprobs)
    assert [(token, raw) for token, _, raw, _ in made] == [("\\xf0", [240])] * 2
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chat_entries(chunk.choices[0].logprobs)
    ]
    assert streamed == made


@pytest.mark.slow
async def test_the_relay_passes_the_upstreams_logprobs_through():
    fast = ("--engine", "simulated", "--delay-ms", "4", "--jitter-ms", "1", "--tokens", "12")
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }

    def logprobs_of(got: Any) -> list[Any]:
        out: list[Any] = []
        for event in got.events:
            if event.data != "[DONE]":
                for choice in json.loads(event.data)["choices"]:
                    out += (choice.get("logprobs") or {}).get("content") or []
        return out

    async with (
        replica(*fast) as (_, upstream),
        replica("--engine", f"upstream:{upstream}/v1") as (_, relay),
    ):
        direct = await post_events(f"{upstream}/v1/chat/completions", body)
        relayed = await post_events(f"{relay}/v1/chat/completions", body)
    assert relayed.status == direct.status == 200
    assert logprobs_of(relayed) == logprobs_of(direct) != []


def test_legacy_text_offsets_count_characters_not_the_tokens_of_a_split_one() -> None:
    # "né😀!" as a byte-level model makes it: é in two one-byte tokens, 😀 in four. Each
    # offset is where the token's text begins in the completion's characters.
    pieces = [b"n", b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98", b"\x80", b"!"]
    tokens = [TokenLogprob(p.decode(errors="replace"), -1.0, p) for p in pieces]
    shape = completion_logprobs(tuple(tokens), TextOffsets())
    assert shape["text_offset"] == [0, 1, 1, 2, 2, 2, 3]
    # Streamed in chunks of three tokens, the offsets are those of the whole completion.
    policy = DeliveryPolicy(holdback_tokens=0, batch_tokens=3)
    pipeline = ReplyPipeline(OpenAIStreamFormat("text", "m", 0), policy, logprobs=True)
    entries = pipeline.start("r")
    made, decoded = b"", ""
    for token in tokens:  # each delta carries the characters its token completed
        made += token.bytes
        text = made.decode(errors="ignore")
        entries += pipeline.push(Delta(text[len(decoded) :], 1, 0.0, logprobs=(token,)), 0.0)
        decoded = text
    entries += pipeline.finish()
    offsets = []
    for entry in entries:
        if entry.data.startswith("{"):
            for choice in json.loads(entry.data)["choices"]:
                offsets += (choice.get("logprobs") or {}).get("text_offset", [])
    assert decoded == "né😀!" and offsets == [0, 1, 1, 2, 2, 2, 3]


def test_a_control_token_is_named_but_moves_no_legacy_text_offset() -> None:
    """``<|im_start|>`` is named as the vocabulary spells it but is no part of the text: the
    token after it begins where it began."""
    tokens = (
        TokenLogprob("Hi", -1.0, b"Hi"),
        TokenLogprob("<|im_start|>", -2.0, b"<|im_start|>", in_text=False),
        TokenLogprob(" there", -1.0, b" there"),
    )
    shape = completion_logprobs(tokens, TextOffsets(4))
    assert shape["tokens"] == ["Hi", "<|im_start|>", " there"]
    assert shape["text_offset"] == [4, 6, 6]


class ByteTokensEngine(ScriptedEngine):
    """Makes byte-level tokens, each with its alternatives at that position (the made one
    first), however many the request asked for."""

    def __init__(self, positions: list[list[bytes]]) -> None:
        super().__init__()
        self.positions = positions

    async def start(self, request: GenerationRequest) -> DeltaStream:
        return self._made()

    async def _made(self) -> AsyncGenerator[Delta]:
        texts = detokenize(candidates[0] for candidates in self.positions)
        for index, (text, candidates) in enumerate(zip(texts, self.positions, strict=True)):
            top = tuple(
                TopLogprob(raw.decode(errors="replace"), -1.0 - rank, raw)
                for rank, raw in enumerate(candidates)
            )
            made = TokenLogprob(*top[0], top)
            last = index == len(texts) - 1
            yield Delta(text, 1, time.monotonic(), "stop" if last else None, logprobs=(made,))


async def test_legacy_logprobs_name_each_partial_character_token_by_its_bytes():
    # U+2019 (e2 80 99) in two tokens; the alternatives to its first are other partial
    # characters, one after a space. As text each would be U+FFFD (one key for all four).
    engine = ByteTokensEngine(
        [
            [b"\xe2\x80", b"\xe2\x81", b"\xf0\x9f", b" \xe6\x9e"],
            [b"\x99", b"\x9c"],
            [b"ok", b"\xe2"],
        ]
    )
    ask: dict[str, Any] = {"model": "scripted", "prompt": "x", "logprobs": 3}
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.completions.create(**ask)
        chunks = [c async for c in await client.completions.create(**ask, stream=True)]
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text == "\u2019ok"
    assert lp is not None and lp.tokens == ["bytes:\\xe2\\x80", "bytes:\\x99", "ok"]
    assert lp.top_logprobs == [
        {
            "bytes:\\xe2\\x80": -1.0,
            "bytes:\\xe2\\x81": -2.0,
            "bytes:\\xf0\\x9f": -3.0,
            "bytes: \\xe6\\x9e": -4.0,
        },
        {"bytes:\\x99": -1.0, "bytes:\\x9c": -2.0},
        {"ok": -1.0, "bytes:\\xe2": -2.0},
    ]
    assert lp.text_offset == [1, 1, 2]  # after the prompt's one character
    streamed: dict[str, list[Any]] = {"tokens": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        piece = chunk.choices[0].logprobs
        if piece is not None:
            for name, values in streamed.items():
                values += getattr(piece, name) or []
    assert streamed == {name: getattr(lp, name) for name in streamed}


async def test_legacy_top_logprobs_keep_the_likeliest_of_tokens_with_one_name():
    # A chat model's control tokens (SmolLM2 has 17) decode to no bytes, so they share the
    # name "": the made one (the likeliest) must keep its own log probability as the key's,
    # not take that of a less likely control token listed after it.
    engine = ByteTokensEngine([[b"", b"ok", b""], [b"ok", b"", b"", b"!"]])
    ask: dict[str, Any] = {"model": "scripted", "prompt": "x", "logprobs": 4}
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.completions.create(**ask)
        chunks = [c async for c in await client.completions.create(**ask, stream=True)]
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.token_logprobs == [-1.0, -1.0]
    assert lp.top_logprobs == [{"": -1.0, "ok": -2.0}, {"ok": -1.0, "": -2.0, "!": -4.0}]
    streamed = [
        top
        for c in chunks
        if c.choices[0].logprobs
        for top in c.choices[0].logprobs.top_logprobs or []
    ]
    assert streamed == lp.top_logprobs


async def test_streamed_legacy_text_offsets_are_places_in_the_text_after_a_held_stop_tail():
    # "ee f" of "three four" may begin the stop string: "thr" goes out with the token
    # "three ", and "ee " goes out later with "four "; every offset after is in the text.
    ask: dict[str, Any] = {
        "model": "simulated",
        "prompt": "x",
        "max_tokens": 6,
        "logprobs": 1,
        "stop": ["ee fx"],
        "extra_body": {"batch_tokens": 1, "holdback_tokens": 0},
    }
    engine = fast_engine(reply_text="one two three four five six")
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.completions.create(**ask)
        chunks = [c async for c in await client.completions.create(**ask, stream=True)]
    text, texts = "", []
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in chunks:
        choice = chunk.choices[0]
        text += choice.text
        texts.append(choice.text)
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens or []
            offsets += choice.logprobs.text_offset or []
    assert "thr" in texts and "ee four " in texts  # the tail was held mid-token
    assert text == whole.choices[0].text == "one two three four five six "
    shown = "x" + text  # the prompt and the completion, as OpenAI's offsets count
    assert [shown[at : at + len(token)] for token, at in zip(tokens, offsets, strict=True)] == [
        "one ",
        "two ",
        "three ",
        "four ",
        "five ",
        "six ",
    ]
    assert whole.choices[0].logprobs is not None
    assert offsets == whole.choices[0].logprobs.text_offset == [1, 5, 9, 15, 20, 25]


async def test_legacy_text_offsets_count_from_the_prompts_start_for_every_choice():
    # OpenAI's text_offset are places in the prompt and the completion together, the prompt
    # not echoed: a 9-character prompt's first completion token is at 9. Each of the two
    # choices counts from its prompt, not from the other's text, streamed and whole.
    ask: dict[str, Any] = {
        "model": "simulated",
        "prompt": "Count up:",
        "max_tokens": 3,
        "logprobs": 1,
        "n": 2,
        "extra_body": {"batch_tokens": 1, "holdback_tokens": 0},
    }
    engine = fast_engine(reply_text="one two three")
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.completions.create(**ask)
        chunks = [c async for c in await client.completions.create(**ask, stream=True)]
    streamed: dict[int, tuple[str, list[str], list[int]]] = {0: ("", [], []), 1: ("", [], [])}
    for chunk in chunks:
        for choice in chunk.choices:
            text, tokens, offsets = streamed[choice.index]
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                offsets += choice.logprobs.text_offset or []
            streamed[choice.index] = (text + choice.text, tokens, offsets)
    for choice in whole.choices:
        assert choice.logprobs is not None
        text, tokens, offsets = streamed[choice.index]
        assert (text, tokens, offsets) == (
            choice.text,
            choice.logprobs.tokens,
            choice.logprobs.text_offset,
        )
        assert tokens == ["one ", "two ", "three "] and offsets == [9, 13, 17]
        shown = ask["prompt"] + text
        places = zip(tokens, offsets, strict=True)
        assert [shown[at : at + len(token)] for token, at in places] == tokens


async def test_a_stop_string_beginning_with_a_split_character_lists_none_of_its_tokens():
    # "🎉" (f0 9f 8e 89) comes in two tokens, the first with no text of its own: both are
    # the stop string's, so neither is listed, streamed or whole, and no chunk without text
    # carries them.
    engine = ByteTokensEngine(
        [[b"ok"], [b"\xf0\x9f", b"ok"], [b"\x8e\x89", b"\x8e\x88"], [b"!"], [b"."]]
    )
    ask: dict[str, Any] = {
        "model": "scripted",
        "messages": [{"role": "user", "content": "x"}],
        "logprobs": True,
        "top_logprobs": 1,
        "stop": ["\U0001f389!"],
    }
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    assert whole.choices[0].message.content == "ok"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].logprobs is not None
    made = chat_entries(whole.choices[0].logprobs)
    assert [token for token, _, _, _ in made] == ["ok"]
    streamed = [
        (choice.delta.content, entry)
        for chunk in chunks
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in chat_entries(choice.logprobs)
    ]
    assert streamed == [("ok", made[0])]
