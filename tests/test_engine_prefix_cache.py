"""Prefix caching: full KV blocks found again by later requests that begin with the same tokens.

The allocator and the scheduler without a model (sharing, parking, eviction, no block lost),
then the tiny engine, whose reply must not change when its prompt's blocks come from the cache.
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import pytest

from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.kv_cache import BlockAllocator
from replystream.engine.prefix_cache import block_digests
from replystream.engine.scheduler import Batch, Scheduler, SchedulerConfig
from replystream.engine.tiny import load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from replystream.server.state import add_state_gauges
from tests.test_state_gauges import gauge

PROMPT = list(range(100, 140))  # 40 tokens: ten blocks of 4


def cached(blocks: int = 32, block_size: int = 4) -> BlockAllocator:
    return BlockAllocator(blocks, block_size, prefix_caching=True)


def compute(a: BlockAllocator, seq_id: int, tokens: list[int]) -> None:
    """What a sequence's prefill does to the allocator: reserve, then name what it filled."""
    start = a.length(seq_id)
    a.reserve(seq_id, len(tokens))
    assert a.length(seq_id) >= start
    a.name_full_blocks(seq_id, tokens, len(tokens))


def test_a_second_sequence_shares_the_first_ones_full_blocks_but_the_last_token():
    a = cached()
    compute(a, 1, PROMPT)
    match = a.match(PROMPT)
    # 39 tokens may match (the last is computed again, for its logits): 9 full blocks.
    assert match.blocks == a.table(1)[:9]
    assert a.adopt(2, match) == 36
    compute(a, 2, PROMPT)
    assert a.table(2)[:9] == a.table(1)[:9] and a.table(2)[9] != a.table(1)[9]
    stats = a.stats()
    assert stats.used_blocks == 11  # ten of the first's, one of the second's own
    assert stats.live_tokens == 40 + 4  # a shared block's tokens count once
    assert stats.wasted_tokens == 0


def test_blocks_match_only_behind_the_same_tokens_from_the_start():
    a = cached()
    compute(a, 1, PROMPT)
    other_start = [7, *PROMPT[1:]]  # the same blocks 2 to 10, after another first token
    assert a.match(other_start).blocks == ()
    assert len(a.match(PROMPT[:21]).blocks) == 5  # a shorter prompt: its own full blocks
    assert a.match(PROMPT[:4]).blocks == ()  # one block whose last token must be computed


def test_a_freed_sequences_named_blocks_stay_cached_until_the_pool_needs_them():
    a = cached(blocks=12)
    compute(a, 1, PROMPT)  # ten blocks, all full and named
    a.free(1)
    stats = a.stats()
    assert stats.used_blocks == 0 and stats.cached_blocks == 10 and stats.free_blocks == 12
    match = a.match(PROMPT)
    assert len(match.blocks) == 9 and a.idle_among(match.blocks) == 9
    a.adopt(2, match)  # taken back from the cache
    assert a.stats().cached_blocks == 1 and a.stats().used_blocks == 9
    a.free(2)
    # Another request needs all twelve: the two never named go first, then the cached ones,
    # the freed sequence's last blocks before its first.
    compute(a, 3, list(range(48)))
    assert a.stats().cached_blocks == 0 and a.match(PROMPT).blocks == ()


def test_eviction_gives_up_the_least_recently_used_prefix_first():
    a = cached(blocks=10)
    first, second = list(range(17)), list(range(50, 67))  # four full blocks each
    compute(a, 1, first)
    a.free(1)
    compute(a, 2, second)
    a.free(2)
    a.adopt(3, a.match(first))  # the first prefix is used again: now the most recent
    a.free(3)
    # Four blocks: the two never named, then two of the second prefix, its tail first.
    compute(a, 4, list(range(90, 106)))
    assert len(a.match(first).blocks) == 4
    assert len(a.match(second).blocks) == 2


def test_digests_chain_every_token_before_a_block():
    tokens = list(range(12))
    whole = list(block_digests(tokens, 4))
    assert len(whole) == 3 and len(set(whole)) == 3
    assert list(block_digests(tokens, 4, start=1, parent=whole[0])) == whole[1:]
    assert list(block_digests([1, *tokens[1:]], 4))[2] != whole[2]


def run(s: Scheduler, batch: Batch, token: int = 7) -> None:
    s.record(batch, {c.seq_id: token for c in batch.chunks if c.samples})


def test_the_scheduler_starts_a_matching_prompts_prefill_past_its_cached_blocks():
    s = Scheduler(cached(blocks=32), SchedulerConfig(token_budget=64, max_running=4))
    s.add(1, PROMPT, max_new=2)
    run(s, s.schedule())
    run(s, s.schedule())  # its second token: it finishes, its blocks stay cached
    s.add(2, [*PROMPT, 1, 2, 3], max_new=2)  # the next turn: the same start, and more
    batch = s.schedule()
    (chunk,) = batch.chunks
    # 40 prompt tokens and the first reply token were computed: ten full blocks, all matched
    # since the next turn's last token is past them.
    assert chunk.start == 40 and chunk.tokens == (1, 2, 3)
    assert s.stats().prefix_hit_tokens == 40
    assert batch.admitted == ((2, 40),)  # what it found cached, for its reply's usage


def test_no_block_leaks_with_prefix_caching_after_1000_random_requests():
    rng = random.Random(7)
    s = Scheduler(cached(blocks=40), SchedulerConfig(token_budget=24, max_running=12))
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 20))] for _ in range(5)]
    added = next_id = 0
    while added < 1000 or s.has_work():
        for _ in range(rng.randint(0, 3)):
            if added < 1000:
                tail = [rng.randrange(50) for _ in range(rng.randint(1, 10))]
                s.add(next_id, [*rng.choice(prefixes), *tail], max_new=rng.randint(1, 20))
                next_id, added = next_id + 1, added + 1
        batch = s.schedule()
        if rng.random() < 0.2 and next_id:
            s.abort(rng.randrange(next_id))
        s.record(batch, {c.seq_id: rng.randrange(50) for c in batch.chunks if c.samples})
        if rng.random() < 0.05 and s.running_ids():
            s.finish(rng.choice(s.running_ids()))
        kv = s.stats().kv
        held = {block for i in s.running_ids() for block in s.allocator.table(i)}
        assert kv.used_blocks == len(held)  # every block in use is held by a running sequence
    stats = s.stats()
    assert stats.kv.used_blocks == 0 and stats.kv.free_blocks == 40
    assert stats.finished + stats.aborted == 1000
    assert stats.prefix_hit_tokens > 1000  # the shared prefixes were found again


@pytest.mark.parametrize("spec_tokens", [0, 4], ids=["plain", "speculative"])
async def test_replies_whose_prompts_come_from_the_cache_are_the_same_replies(spec_tokens: int):
    """Three requests, each resending the one before and its reply (greedy), on an engine
    with the cache and on one without; with speculative decoding too, whose rejected draft
    positions are rolled back inside blocks the cache must not have named."""
    prompt = "And the LORD spake unto Moses, saying, Speak unto the children of Israel. " * 4
    replies: dict[bool, list[str]] = {}
    for caching in (False, True):
        config = TinyEngineConfig(prefix_caching=caching, spec_tokens=spec_tokens)
        engine = load_default_engine(config)
        texts: list[str] = []
        try:
            for _ in range(3):
                request = GenerationRequest(
                    prompt + "".join(texts), SamplingParams(max_tokens=40, temperature=0.0)
                )
                texts.append("".join([d.text async for d in await engine.start(request)]))
            stats = engine.scheduler_stats()
        finally:
            await engine.aclose()
        replies[caching] = texts
        assert stats.kv.used_blocks == 0
        assert (stats.prefix_hit_tokens > 0) == caching
        assert stats.prefix_hit_tokens % 16 == 0  # whole blocks
    assert replies[True] == replies[False] and all(replies[True])


async def test_a_chats_next_turn_is_served_from_the_cache_as_metrics_and_usage_show():
    """Over HTTP: the second turn resends the first turn and its reply; /metrics counts the
    prompt tokens its prefill skipped, and the blocks kept between the turns; each reply's
    usage says how many of its prompt tokens were cached, as vLLM's and llama.cpp's do."""
    engine = load_default_engine(TinyEngineConfig(prefix_caching=True))
    app = create_app(engine)
    add_state_gauges(app)
    system = "Thou shalt answer as the scribes of old answered, in the words of the book. " * 3
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Who spake unto Moses?"},
    ]
    async with running(app) as url, aiohttp.ClientSession() as session:
        usages: list[dict[str, Any]] = []

        async def turn(max_tokens: int = 12) -> str:
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                answer = await response.json()
                usages.append(answer["usage"])
                reply: str = answer["choices"][0]["message"]["content"]
                return reply

        first = await turn()
        between = await (await session.get(f"{url}/metrics")).text()
        messages += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And what did he say?"},
        ]
        await turn()
        after = await (await session.get(f"{url}/metrics")).text()
        await turn(max_tokens=1)  # a reply of one token: it ends in the step that counts it
    assert gauge(between.encode(), "replystream_engine_prefix_hit_tokens") == 0
    assert gauge(between.encode(), "replystream_kv_blocks_cached") > 0
    hits = gauge(after.encode(), "replystream_engine_prefix_hit_tokens")
    assert hits >= 32
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    # The same prompt again: every whole block of it was cached by the turn before (its
    # last token is computed again, for the logits the first token is picked from).
    again = usages[2]["prompt_tokens"]
    assert cached == [0, hits, (again - 1) // 16 * 16]
    assert cached[2] > hits


async def test_an_engine_without_the_cache_says_nothing_of_cached_tokens():
    engine = load_default_engine(TinyEngineConfig())
    body = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 2}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            usage = (await response.json())["usage"]
    assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] > 0
