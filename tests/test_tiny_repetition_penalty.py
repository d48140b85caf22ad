"""A repetition penalty near 0, within its range (0 excluded), divides the positive logits of
the tokens seen by so little that they pass the largest float32: they become the likeliest
tokens (all alike), never a NaN that draws the vocabulary's last token."""

from __future__ import annotations

import json

import numpy as np

from replystream.engine.base import SamplingParams
from replystream.engine.sampling import TokenHistory, filtered_probabilities, penalize
from replystream.engine.tiny import load_default_engine
from replystream.server import create_app, running
from tests.sse_client import post_events

PROMPT = "And the LORD spake unto Moses, saying,"


def test_a_tiny_penalty_leaves_a_distribution() -> None:
    logits = np.array([2.0, -2.0, 1.0, 3.0], dtype=np.float32)
    params = SamplingParams(repetition_penalty=1e-300, temperature=1.0)
    penalized = penalize(logits, params, TokenHistory([0, 1]))
    assert np.isfinite(penalized).all()
    p = filtered_probabilities(penalized, params)
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]  # token 0, seen with a positive logit


async def test_the_tiny_model_repeats_the_prompt_under_a_tiny_penalty() -> None:
    engine = load_default_engine()
    seen = {engine.tokenizer.decode([token]) for token in engine.tokenizer.encode(PROMPT)}
    ask = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1, "seed": 3, "logprobs": 0}
    try:
        async with running(create_app(engine)) as url:
            got = await post_events(f"{url}/v1/completions", {**ask, "repetition_penalty": 1e-300})
    finally:
        await engine.aclose()
    assert got.status == 200, got.raw
    tokens = json.loads(got.raw)["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= seen, tokens
