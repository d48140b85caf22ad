"""Presence, frequency and repetition penalties and logit biases: applied by the built-in
models' sampler as vLLM applies them, refused where they have no meaning, and relayed to an
upstream."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from replystream.engine.base import RequestRejected, SamplingParams
from replystream.engine.sampling import TokenHistory, check_sampling, penalize
from replystream.engine.tiny import load_default_engine
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.sse_client import post_events
from tests.test_upstream_faults import fake_upstream

PROMPT = "And the LORD spake unto Moses, saying,"


def test_penalties_change_the_logits_of_the_tokens_seen_as_vllm_does() -> None:
    logits = np.array([2.0, -2.0, 1.0, 3.0, 0.5], dtype=np.float32)
    history = TokenHistory([0, 1])  # the prompt
    for token in (2, 2, 3):  # the reply so far
        history.add(token)
    frequency = penalize(logits, SamplingParams(frequency_penalty=0.5), history)
    assert frequency.tolist() == [2.0, -2.0, 0.0, 2.5, 0.5]  # only the reply's tokens
    presence = penalize(logits, SamplingParams(presence_penalty=0.5), history)
    assert presence.tolist() == [2.0, -2.0, 0.5, 2.5, 0.5]
    repetition = penalize(logits, SamplingParams(repetition_penalty=2.0), history)
    assert repetition.tolist() == [1.0, -4.0, 0.5, 1.5, 0.5]  # prompt and reply alike
    assert logits.tolist() == [2.0, -2.0, 1.0, 3.0, 0.5]  # a copy: the model's own kept
    biased = penalize(logits, SamplingParams(logit_bias=((1, 100.0), (3, -100.0))), history)
    assert biased.tolist() == [2.0, 98.0, 1.0, -97.0, 0.5]
    # vLLM adds the biases first (a logits processor) and penalizes the biased logits: a
    # seen token's bias is divided or multiplied with it, and may turn its sign first.
    both = SamplingParams(repetition_penalty=2.0, logit_bias=((0, 2.0), (1, 3.0), (3, -1.0)))
    assert penalize(logits, both, history).tolist() == [2.0, 0.5, 0.5, 1.0, 0.5]


def test_a_repetition_penalty_of_zero_is_refused() -> None:
    with pytest.raises(RequestRejected) as refused:
        check_sampling(SamplingParams(repetition_penalty=0.0))
    assert refused.value.param == "repetition_penalty"


async def test_the_tiny_model_honours_penalties_over_the_api() -> None:
    engine = load_default_engine()
    base = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "logprobs": 0}
    try:
        async with running(create_app(engine)) as url:
            replies = {}
            for name, extra in (
                ("plain", {}),
                ("repetition", {"repetition_penalty": 10}),
                ("frequency", {"frequency_penalty": 2}),
            ):
                got = await post_events(f"{url}/v1/completions", {**base, **extra})
                assert got.status == 200, got.raw
                replies[name] = json.loads(got.raw)["choices"][0]["logprobs"]["tokens"]
            zero = await post_events(f"{url}/v1/completions", {**base, "repetition_penalty": 0})
    finally:
        await engine.aclose()
    repeats = {name: max(Counter(tokens).values()) for name, tokens in replies.items()}
    assert repeats["plain"] >= 3  # greedy, this model says the same words again and again
    assert repeats["repetition"] == 1  # every token seen is a tenth as likely: none again
    assert repeats["frequency"] < repeats["plain"]
    assert zero.status == 400 and json.loads(zero.raw)["error"]["param"] == "repetition_penalty"


async def test_a_repetition_penalty_of_zero_is_refused_by_every_engine_as_a_bad_value() -> None:
    """It divides a logit: 0 is no penalty. Only the built-in models refused it (with a code
    no table listed); the simulated engine and a relay took it."""
    ask = {"model": "simulated", "messages": [{"role": "user", "content": "hi"}]}
    async with running(create_app(fast_engine())) as url:
        got = await post_events(f"{url}/v1/chat/completions", {**ask, "repetition_penalty": 0})
    error = json.loads(got.raw)["error"]
    assert got.status == 400
    assert (error["param"], error["code"]) == ("repetition_penalty", "invalid_value")


async def test_the_relay_passes_the_penalties_on_when_given() -> None:
    question = [{"role": "user", "content": "hi"}]
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/ok/v1"),), model="m"))
        async with running(create_app(engine)) as relay:
            given = {
                "presence_penalty": 0.5,
                "frequency_penalty": -1,
                "repetition_penalty": 1.2,
                "logit_bias": {"7": -100, "42": 2.5},
            }
            for body in ({"messages": question, **given}, {"messages": question}):
                assert (await post_events(f"{relay}/v1/chat/completions", body)).status == 200
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    assert [{n: b[n] for n in names if n in b} for b in fake.bodies] == [given, {}]


async def test_the_tiny_model_honours_logit_bias_over_the_api() -> None:
    engine = load_default_engine()
    forced = engine.tokenizer.encode(" Egypt")
    assert len(forced) == 1
    base = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    try:
        async with running(create_app(engine)) as url:

            async def complete(**extra: object) -> tuple[int, dict[str, object]]:
                got = await post_events(f"{url}/v1/completions", {**base, **extra})
                return got.status, json.loads(got.raw)

            _, plain = await complete()
            _, favoured = await complete(logit_bias={str(forced[0]): 100})
            first = engine.tokenizer.encode(plain["choices"][0]["text"])[0]  # type: ignore[index]
            _, banned = await complete(logit_bias={str(first): -100})
            unknown = await complete(logit_bias={"4096": 1})
            not_an_id = await complete(logit_bias={"Egypt": 1})
    finally:
        await engine.aclose()
    assert favoured["choices"][0]["text"] == " Egypt" * 4  # type: ignore[index]
    banned_text = banned["choices"][0]["text"]  # type: ignore[index]
    assert engine.tokenizer.encode(banned_text)[0] != first
    assert unknown[0] == 400 and unknown[1]["error"]["param"] == "logit_bias"  # type: ignore[index]
    assert not_an_id[0] == 400
