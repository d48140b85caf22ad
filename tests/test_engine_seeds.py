"""A request without a seed: a model engine samples it with a fresh seed (asking again makes
another reply), unless the server was started with ``--seed N``, which such requests then use.

Over ``replystream serve --engine tiny`` in a child process, through the OpenAI routes; and
the tiny engine stepped by hand, where a preempted reply must keep the seed drawn for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

from replystream.engine import seeds
from replystream.engine.base import Delta, GenerationRequest, SamplingParams
from replystream.engine.tiny import load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from tests.processes import replica

PROMPT = "And the LORD spake unto Moses, saying,"
# 48 tokens at temperature 1 from the tiny model: two draws making the same text would take
# every one of 48 picks to agree.
ASK: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 1}


async def texts(url: str, **extra: Any) -> list[str]:
    """The text of each choice of one (not streamed) completion."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json={**ASK, **extra}) as response,
    ):
        assert response.status == 200, await response.text()
        body = await response.json()
    return [choice["text"] for choice in sorted(body["choices"], key=lambda c: c["index"])]


async def test_two_requests_without_a_seed_make_different_replies_and_a_given_seed_repeats():
    async with replica("--engine", "tiny") as (_, url):
        [first], [second] = await texts(url), await texts(url)
        [seeded], [again] = await texts(url, seed=5), await texts(url, seed=5)
        several = await texts(url, n=2)
        greedy = [await texts(url, temperature=0) for _ in range(2)]
    assert len(first.split()) > 10 and len(second.split()) > 10
    assert first != second  # drawn afresh: "regenerate" regenerates
    assert seeded == again  # a client's own seed reproduces its reply
    assert several[0] != several[1]  # one fresh seed for the request, seed + i per choice
    assert greedy[0] == greedy[1]  # temperature 0 draws nothing


async def test_a_seed_is_any_64_bit_integer_negative_ones_too():
    """OpenAI's ``seed`` is an int64: a negative one is a seed like any other, and the
    choices of the largest wrap to the smallest."""
    smallest, largest = -(1 << 63), (1 << 63) - 1
    async with replica("--engine", "tiny") as (_, url):
        [minus], [again], [plus] = [await texts(url, seed=seed) for seed in (-5, -5, 5)]
        several = await texts(url, n=2, seed=largest, max_tokens=12)
        alone = [(await texts(url, seed=seed, max_tokens=12))[0] for seed in (largest, smallest)]
        async with aiohttp.ClientSession() as http:
            for seed in (smallest - 1, largest + 1):
                body = {**ASK, "seed": seed}
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 400, seed
                    assert (await response.json())["error"]["param"] == "seed"
    assert minus == again and minus != plus
    assert several == alone and alone[0] != alone[1]


async def test_serve_seed_makes_requests_without_a_seed_repeat_as_that_seed():
    async with replica("--engine", "tiny", "--seed", "7") as (_, url):
        [first], [second] = await texts(url), await texts(url)
        [as_seven] = await texts(url, seed=7)
        [own] = await texts(url, seed=5)
        # Short: two choices run batched, and a batch may move a logit by 1e-5 (docs/model.md),
        # which could flip a draw that lands that close to a boundary; 12 tokens still tell
        # seeds apart.
        several = await texts(url, n=2, max_tokens=12)
        alone = [(await texts(url, seed=seed, max_tokens=12))[0] for seed in (7, 8)]
    assert first == second == as_seven  # the server's seed, for every request without one
    assert several == alone  # its choices take 7 + i
    assert alone[0] != alone[1]
    assert own != first  # a request's own seed still wins


async def test_a_preempted_reply_keeps_the_seed_drawn_for_it(monkeypatch: pytest.MonkeyPatch):
    """Four replies without a seed on a pool too small for them: some are preempted and
    recomputed. Each must be the reply of the one seed drawn for its request, which the same
    run with those seeds given explicitly (stepped alike, so batched alike) makes again."""
    drawn: list[int] = []

    def recorded() -> int:
        seed = fresh()
        drawn.append(seed)
        return seed

    fresh = seeds.fresh_seed
    monkeypatch.setattr(seeds, "fresh_seed", recorded)
    unseeded, preemptions = await stepped_replies([None] * 4)
    assert len(drawn) == 4 and len(set(drawn)) == 4  # one draw per request, no more
    assert preemptions > 0
    replayed, _ = await stepped_replies(drawn)
    assert len(drawn) == 4  # the seeded run drew none
    assert unseeded == replayed
    assert len(set(unseeded)) == 4


async def stepped_replies(seeds_given: Sequence[int | None]) -> tuple[list[str], int]:
    """The texts of 60-token replies to ``PROMPT`` at temperature 1, one per seed, on a pool
    of 10 blocks; the runner stepped by hand (no worker thread), so the batches are the
    same on every run. Also how many preemptions there were."""
    engine = load_default_engine(TinyEngineConfig(num_blocks=10, block_size=16))
    runner = engine.runner
    runner.start = lambda: None  # type: ignore[method-assign]  # stepped here instead
    try:
        streams = [
            await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=60, seed=s)))
            for s in seeds_given
        ]
        runner.step()  # takes the submitted requests in
        while runner.scheduler.has_work():
            runner.step()
        await asyncio.sleep(0)  # the deltas were handed to the loop: all of them arrived
        replies: list[list[Delta]] = [[d async for d in stream] for stream in streams]
        assert [sum(d.tokens for d in r) for r in replies] == [60] * len(seeds_given)
        return ["".join(d.text for d in r) for r in replies], runner.scheduler_stats().preemptions
    finally:
        await engine.aclose()
