"""``n > 1``: several choices from one request, each its own generation, interleaved on one
stream, each finishing on its own, usage summed; resumable like any reply. The merge and the
pipeline alone first, then real servers with the official openai SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.delivery.choices import ChoicesPipeline
from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.openai_formats import OpenAIStreamFormat
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Delta, EngineError
from replystream.engine.choices import ChoicesStream
from replystream.engine.tiny import load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.sse_client import post_events


def formats(n: int, include_usage: bool = True) -> list[OpenAIStreamFormat]:
    return [
        OpenAIStreamFormat("chat", "m", 0, include_usage, i, one_of_many=True) for i in range(n)
    ]


def test_a_choice_that_meets_its_stop_string_finishes_at_once_and_the_others_go_on():
    done: list[int] = []
    fmts = formats(2)
    pipeline = ChoicesPipeline(
        fmts,
        fmts[0].reply_end,
        DeliveryPolicy(),
        stops=("STOP",),
        on_choice_done=done.append,
        prompt_estimate=2,
    )
    entries = pipeline.start("r")
    for delta in [
        Delta("a ", choice=0),
        Delta("b ", choice=1),
        Delta("ST", choice=0),
        Delta("OP x", choice=0),  # completes the stop string of choice 0
        Delta("never", choice=0),  # made before its generation was stopped: not shown
        Delta("c", choice=1, finish_reason="length"),
    ]:
        entries += pipeline.push(delta, 0.0)
    assert done == [0]  # its generation is stopped; choice 1's ended by itself
    entries += pipeline.finish()
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))  # one numbering
    chunks = [json.loads(e.data) for e in entries if e.data != "[DONE]"]
    assert entries[-1].data == "[DONE]" and sum(e.data == "[DONE]" for e in entries) == 1
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert [f for f in finishes if f[1]] == [(0, "stop"), (1, "length")]
    text: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        choice = chunk["choices"][0]
        text[choice["index"]] += choice["delta"].get("content") or ""
    assert text == {0: "a ", 1: "b c"}
    assert chunks[-1]["choices"] == []
    # Three of choice 0 (to the one completing the stop string), two of choice 1.
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens"] == 2  # once, not per choice


class Scripted:
    """A pull delta stream with set delays, that records being closed."""

    def __init__(self, pieces: list[tuple[float, str]], fail: bool = False) -> None:
        self.pieces = pieces
        self.fail = fail
        self.closed = False
        self._iterator = self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        for delay, text in self.pieces:
            await asyncio.sleep(delay)
            yield Delta(text)
        if self.fail:
            raise EngineError("boom")

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iterator

    async def __anext__(self) -> Delta:
        return await self._iterator.__anext__()

    async def aclose(self) -> None:
        self.closed = True


async def test_merged_choices_come_in_the_order_they_are_made_and_each_can_be_stopped():
    slow = Scripted([(0.05, "s1"), (0.2, "s2"), (0.2, "s3")])
    fast = Scripted([(0.0, "f1"), (0.0, "f2"), (0.0, "f3")])
    merged = ChoicesStream([slow, fast])
    got = []
    async for delta in merged:
        got.append((delta.choice, delta.text))
        if delta.text == "s1":
            merged.close_choice(0)
    assert got == [(1, "f1"), (1, "f2"), (1, "f3"), (0, "s1")]
    assert slow.closed and fast.closed


async def test_one_failing_choice_fails_the_merge_and_closes_the_others():
    failing = Scripted([(0.0, "a")], fail=True)
    endless = Scripted([(0.05, "x")] * 100)
    merged = ChoicesStream([failing, endless])
    with pytest.raises(EngineError):
        async for _ in merged:
            pass
    assert failing.closed and endless.closed


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


TINY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "And the LORD said unto Moses,"}],
    "max_tokens": 10,
    "temperature": 0.9,
    "seed": 7,
    "n": 3,
}


async def test_n_3_gives_three_different_choices_indexed_0_to_2_streamed_and_whole():
    async with running(create_app(load_default_engine())) as url, sdk(url) as client:
        whole = await client.chat.completions.create(**TINY)
        stream = await client.chat.completions.create(
            **TINY, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        legacy = await client.completions.create(
            model="tiny", prompt="And the LORD", max_tokens=6, n=3, seed=7
        )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 3  # each its own generation
    streamed = {0: "", 1: "", 2: ""}
    finishes: list[tuple[int, str]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.append((choice.index, choice.finish_reason))
    assert [streamed[i] for i in range(3)] == texts  # the same seeds, the same choices
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    assert whole.usage is not None and chunks[-1].usage is not None and not chunks[-1].choices
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 30
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert [c.index for c in legacy.choices] == [0, 1, 2] and len(
        {c.text for c in legacy.choices}
    ) == 3


async def test_choices_are_interleaved_as_made_and_a_resume_gets_the_same_stream():
    body = {
        "messages": [{"role": "user", "content": "count"}],
        "n": 2,
        "max_tokens": 12,
        "stream": True,
        "resumable": True,
    }
    async with running(create_app(fast_engine())) as url:
        first = await post_events(f"{url}/v1/chat/completions", body)
        reply_id = first.headers["x-reply-id"]
        cut = 7
        async with (
            aiohttp.ClientSession() as http,
            http.get(
                f"{url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": str(cut)}
            ) as response,
        ):
            resumed = await response.read()
    events = first.events
    chunks = [json.loads(e.data) for e in events if e.data != "[DONE]"]
    order = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert sorted(set(order)) == [0, 1]
    assert order != sorted(order)  # interleaved, not one choice after the other
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]
    tail = b"".join(f"id: {e.id}\ndata: {e.data}\n\n".encode() for e in events if int(e.id) > cut)
    assert resumed.replace(b": keep-alive\n", b"") == tail


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 129}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 1.5}, "n"),
        ("/v1/responses", {"input": "x", "n": 2}, "n"),
    ],
)
async def test_a_bad_or_unknown_n_is_a_400_naming_it(path: str, body: dict[str, Any], param: str):
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == param


async def test_anthropic_messages_refuse_n_in_anthropics_shape():
    body = {
        "model": "simulated",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "n": 2,
    }
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/messages", json=body) as response:
            assert response.status == 400
            answer = await response.json()
    assert answer["type"] == "error" and answer["error"]["param"] == "n"


def test_a_check_stops_one_choice_only_and_a_failure_ends_every_choice_with_one_error():
    done: list[int] = []
    fmts = formats(2, include_usage=False)
    policy = DeliveryPolicy(checks=[BannedPhrases(["bad"])])
    pipeline = ChoicesPipeline(fmts, fmts[0].reply_end, policy, on_choice_done=done.append)
    entries = pipeline.start("r")
    for delta in [Delta("ok ", choice=0), Delta("so bad", choice=1), Delta("fine", choice=0)]:
        entries += pipeline.push(delta, 0.0)
    assert done == [1] and pipeline.violation is None and not pipeline.halted
    entries += pipeline.finish()
    chunks = [json.loads(e.data) for e in entries if e.data != "[DONE]"]
    finishes = [
        (c["choices"][0]["index"], c["choices"][0]["finish_reason"])
        for c in chunks
        if c["choices"][0]["finish_reason"]
    ]
    assert finishes == [(1, "content_filter"), (0, "stop")]
    assert [e.data for e in entries].count("[DONE]") == 1
    failing = ChoicesPipeline(fmts, fmts[0].reply_end, DeliveryPolicy(batch_tokens=5))
    failing.start("r")
    held = failing.push(Delta("made ", choice=1), 0.0)
    assert held == []  # batched
    ended = failing.fail("engine died", "generation_failed")
    assert [e.event for e in ended] == [None, "error"]  # the batched text, then one error
    assert json.loads(ended[0].data)["choices"][0]["delta"]["content"] == "made "


async def test_stopping_a_choice_cancels_the_step_it_waits_for_at_once():
    stuck = Scripted([(30.0, "never")])
    quick = Scripted([(0.0, "q1"), (0.05, "q2")])
    merged = ChoicesStream([stuck, quick])
    got = []
    async with asyncio.timeout(5):
        async for delta in merged:
            got.append(delta.text)
            merged.close_choice(0)  # the stuck generation must not hold the merge
    assert got == ["q1", "q2"] and stuck.closed and quick.closed


async def test_each_choice_gets_its_own_stop_cut_and_logprobs_streamed_as_whole():
    ask: dict[str, Any] = {
        "model": "simulated",
        "messages": [{"role": "user", "content": "count"}],
        "n": 2,
        "stop": ["ee fo"],
        "logprobs": True,
        "top_logprobs": 1,
        "extra_body": {"batch_tokens": 2},
    }
    engine = fast_engine(reply_text="one two three four five six")
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.chat.completions.create(**ask)
        stream = await client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    texts = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                tokens[choice.index] += [e.token for e in choice.logprobs.content]
    for choice in whole.choices:
        assert choice.message.content == texts[choice.index] == "one two thr"
        assert choice.finish_reason == "stop"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [e.token for e in choice.logprobs.content] == tokens[choice.index]
    assert tokens[0] == ["one ", "two ", "three "]
    assert whole.usage is not None and chunks[-1].usage is not None
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 8


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "b", "ab", " ", "ba "]), max_size=8), min_size=2, max_size=3
    ),
    st.lists(st.integers(0, 2), max_size=30),
    st.lists(st.sampled_from(["ab", "bb", "a a"]), max_size=2),
)
def test_interleaved_choices_each_end_as_a_single_reply_would(
    replies: list[list[str]], order: list[int], stops: list[str]
) -> None:
    n = len(replies)
    fmts = formats(n)
    pipeline = ChoicesPipeline(fmts, fmts[0].reply_end, DeliveryPolicy(), stops=tuple(stops))
    entries = pipeline.start("r")
    queues = [list(tokens) for tokens in replies]
    picks = [i % n for i in order] + [i for i in range(n) for _ in replies[i]]
    for index in picks:
        if queues[index]:
            text = queues[index].pop(0)
            last = "length" if not queues[index] else None
            entries += pipeline.push(Delta(text, choice=index, finish_reason=last), 0.0)
    entries += pipeline.finish()
    assert [e.data for e in entries].count("[DONE]") == 1 and entries[-1].data == "[DONE]"
    texts = [""] * n
    finished = [0] * n
    for entry in entries[:-2]:  # the usage chunk and [DONE] last
        choice = json.loads(entry.data)["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        finished[choice["index"]] += choice["finish_reason"] is not None
    for index, tokens in enumerate(replies):
        whole = "".join(tokens)
        ends = [whole.find(s) + len(s) for s in stops if s in whole]
        cut = min(ends, default=None)
        expected = (
            whole
            if cut is None
            else whole[
                : min(whole.find(s) for s in stops if s in whole and whole.find(s) + len(s) == cut)
            ]
        )
        assert texts[index] == expected
    assert finished == [1] * n


async def test_whole_and_streamed_choices_count_a_fresh_prompt_as_not_cached():
    # Each choice is its own generation of one prompt: the later ones find it in the prefix
    # cache the first just filled. The usage is the first choice's, streamed and whole.
    engine = load_default_engine(TinyEngineConfig(prefix_caching=True))
    async with running(create_app(engine)) as url, sdk(url) as client:
        fresh: Any = [{"role": "user", "content": "lamb " * 60}]
        whole = await client.chat.completions.create(
            model="tiny", messages=fresh, max_tokens=3, n=3
        )
        again = await client.chat.completions.create(
            model="tiny", messages=fresh, max_tokens=3, n=3
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "goat " * 60}],
            max_tokens=3,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        streamed = [chunk async for chunk in stream][-1].usage
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert streamed is not None and streamed.prompt_tokens_details is not None
    assert streamed.prompt_tokens_details.cached_tokens == 0
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens  # asked again: now it is cached
