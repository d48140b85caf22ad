"""A request's reply does not depend on how it was scheduled: alone, or batched with others of
other lengths and settings, preempted on a small pool, served from the prefix cache, verified
by speculative decoding, or beside a request cancelled mid-way.

The runner is stepped by hand (no worker thread), so each run batches alike every time and the
comparison is exact for tokens, text, finish reasons and token counts; log probabilities may
differ by float32 rounding between batch shapes (docs/model.md), so they are compared within a
tolerance, token by token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.tiny import load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig

SYSTEM = "And the LORD spake unto Moses, saying, Speak unto the children of Israel, "
# Prompts of other lengths: one ends on a 16-byte block boundary, one is a prefix of another,
# several share a long first part (the prefix cache finds it).
REQUESTS: tuple[tuple[str, SamplingParams], ...] = (
    (SYSTEM + "and say", SamplingParams(max_tokens=20, temperature=0, logprobs=3)),
    (
        SYSTEM + "and say unto them,",
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=5, logprobs=2),
    ),
    ("In the beginning", SamplingParams(max_tokens=24, temperature=1.0, seed=123, logprobs=0)),
    ("0123456789abcdef", SamplingParams(max_tokens=12, temperature=0, stop=("the",))),
    (
        SYSTEM,
        SamplingParams(
            max_tokens=18, temperature=0.7, seed=9, logit_bias=((101, 3.0),), logprobs=1
        ),
    ),
    (SYSTEM + "and", SamplingParams(max_tokens=24, temperature=0, frequency_penalty=0.5)),
    ("The", SamplingParams(max_tokens=10, temperature=1.2, min_p=0.05, seed=77, logprobs=4)),
)


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str | None
    tokens: int
    logprobs: tuple[tuple[str, float, tuple[str, ...]], ...]  # token, its logprob, the top


async def stepped(
    config: TinyEngineConfig,
    requests: Sequence[tuple[str, SamplingParams]],
    cancel: tuple[int, int] | None = None,
) -> tuple[list[Reply | None], int]:
    """The replies to ``requests`` submitted together, the runner stepped by hand; with
    ``cancel`` = (index, steps), that request's stream is closed after that many steps (its
    reply is None). Also how many preemptions there were; the pool must be empty after."""
    engine = load_default_engine(config)
    runner = engine.runner
    runner.start = lambda: None  # type: ignore[method-assign]  # stepped here instead
    try:
        streams = [
            await engine.start(GenerationRequest(prompt, sampling)) for prompt, sampling in requests
        ]
        steps = 0
        while steps == 0 or runner.scheduler.has_work():
            if cancel is not None and steps == cancel[1]:
                await streams[cancel[0]].aclose()
            runner.step()
            steps += 1
        await asyncio.sleep(0)  # the deltas were handed to the loop: all of them arrived
        replies: list[Reply | None] = []
        for index, stream in enumerate(streams):
            if cancel is not None and index == cancel[0]:
                replies.append(None)
                continue
            deltas = [d async for d in stream]
            entries = tuple(
                (lp.token, lp.logprob, tuple(t.token for t in lp.top))
                for d in deltas
                for lp in d.logprobs or ()
            )
            replies.append(
                Reply(
                    "".join(d.text for d in deltas),
                    deltas[-1].finish_reason,
                    sum(d.tokens for d in deltas),
                    entries,
                )
            )
        stats = engine.scheduler_stats()
        assert stats.kv.used_blocks == 0 and stats.running == stats.waiting == 0
        return replies, stats.preemptions
    finally:
        await engine.aclose()


def assert_same(alone: Reply | None, batched: Reply | None) -> None:
    assert alone is not None and batched is not None
    assert (batched.text, batched.finish_reason, batched.tokens) == (
        alone.text,
        alone.finish_reason,
        alone.tokens,
    )
    assert [e[0] for e in batched.logprobs] == [e[0] for e in alone.logprobs]
    for (_, mine, _), (_, theirs, _) in zip(batched.logprobs, alone.logprobs, strict=True):
        assert mine == pytest.approx(theirs, abs=2e-4)


@pytest.fixture(scope="module")
def alone() -> list[Reply | None]:
    async def each() -> list[Reply | None]:
        return [(await stepped(TinyEngineConfig(), [r]))[0][0] for r in REQUESTS]

    return asyncio.run(each())


CONFIGS = {
    "batched": TinyEngineConfig(),
    "small-pool": TinyEngineConfig(num_blocks=14, block_size=4, token_budget=32),
    "small-blocks": TinyEngineConfig(num_blocks=40, block_size=4, token_budget=7, max_running=3),
    "prefix-cache": TinyEngineConfig(prefix_caching=True, block_size=8, num_blocks=20),
    "speculative": TinyEngineConfig(spec_tokens=4),
    "all-at-once": TinyEngineConfig(
        num_blocks=18, block_size=8, token_budget=32, prefix_caching=True, spec_tokens=3
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
async def test_every_reply_is_its_alone_reply_however_it_is_batched(
    config: TinyEngineConfig, alone: list[Reply | None]
) -> None:
    together, _ = await stepped(config, REQUESTS)
    for mine, theirs in zip(together, alone, strict=True):
        assert_same(theirs, mine)


async def test_a_small_pool_preempts_and_the_replies_stay_the_same(
    alone: list[Reply | None],
) -> None:
    together, preemptions = await stepped(CONFIGS["small-pool"], REQUESTS)
    assert preemptions > 0  # the case is exercised, not only allowed
    for mine, theirs in zip(together, alone, strict=True):
        assert_same(theirs, mine)


@pytest.mark.parametrize("steps", [0, 1, 4])
async def test_cancelling_one_request_mid_batch_leaves_the_others_replies_unchanged(
    steps: int, alone: list[Reply | None]
) -> None:
    """A long greedy reply cut after ``steps`` steps (before its prefill, mid-reply); every
    other reply is its alone reply, and the pool is empty afterwards (``stepped``)."""
    victim = (SYSTEM * 2, SamplingParams(max_tokens=60, temperature=0))
    for config in (CONFIGS["batched"], CONFIGS["all-at-once"]):
        together, _ = await stepped(config, [*REQUESTS[:3], victim, *REQUESTS[3:]], (3, steps))
        del together[3]
        for mine, theirs in zip(together, alone, strict=True):
            assert_same(theirs, mine)
