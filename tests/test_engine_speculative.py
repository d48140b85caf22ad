"""Prompt-lookup speculative decoding in the tiny engine: same reply, fewer steps."""

from __future__ import annotations

import asyncio

import openai
import pytest

from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.kv_cache import BlockAllocator
from replystream.engine.scheduler import Scheduler, SchedulerConfig
from replystream.engine.speculative import accept, propose
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running

PROMPTS = (
    "And the LORD said unto Moses,",
    "These are the generations of",
    "",
    "And he said, Behold, here am I. And he said, Behold, here am I. And he said,",
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep.",
)
REPETITIVE = "the children of Judah, the children of Levi, the children of Judah, the children of"


async def reply(engine: TinyEngine, prompt: str, **sampling: object) -> tuple[str, list[int]]:
    params = SamplingParams(**{"max_tokens": 80, "temperature": 0.0, **sampling})  # type: ignore[arg-type]
    stream = await engine.start(GenerationRequest(prompt, params))
    texts, counts = [], []
    async for delta in stream:
        texts.append(delta.text)
        counts.append(delta.tokens)
    return "".join(texts), counts


@pytest.fixture
async def engines():
    plain = load_default_engine()
    spec = load_default_engine(TinyEngineConfig(spec_tokens=4, spec_ngram=3))
    yield plain, spec
    await plain.aclose()
    await spec.aclose()


def test_propose_takes_what_followed_the_latest_match_of_the_longest_tail():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose(tokens, max_ngram=3, max_draft=2) == (7, 8)  # the later match wins
    assert propose([4, 5, 6, 5], max_ngram=3, max_draft=4) == (6, 5)  # falls back to a 1-gram
    assert propose([1, 2, 3, 4], max_ngram=3, max_draft=4) == ()  # nothing repeats
    assert propose([1, 1], max_ngram=3, max_draft=0) == ()


def test_accept_keeps_agreeing_draft_tokens_then_the_models_own():
    picks = {0: 5, 1: 6, 2: 9, 3: 1}
    assert accept([0, 1, 2, 3], [5, 6, 7], picks.__getitem__) == [5, 6, 9]
    assert accept([0, 1, 2, 3], [5, 6, 9], picks.__getitem__) == [5, 6, 9, 1]  # all + bonus
    assert accept([0, 1], [4], picks.__getitem__) == [5]  # rejected at once: one token


def test_rejected_draft_positions_give_their_blocks_back():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    scheduler = Scheduler(allocator, SchedulerConfig(token_budget=64, spec_tokens=4))
    scheduler.add(0, [1, 2, 3, 1, 2], max_new=10)
    prefill = scheduler.schedule()
    scheduler.record(prefill, {0: 3})  # tokens 1 2 3 1 2 3: the tail "1 2 3" drafts "1 2 3"
    step = scheduler.schedule()
    (chunk,) = step.chunks
    assert chunk.tokens == (3, 1, 2, 3) and chunk.draft == 3
    assert allocator.length(0) == 9 and len(allocator.table(0)) == 3
    scheduler.record(step, {0: [1, 7]})  # draft token 1 accepted, then 7 instead of 2
    assert allocator.length(0) == 7 and len(allocator.table(0)) == 2
    assert scheduler.stats().draft_proposed == 3 and scheduler.stats().draft_accepted == 1
    scheduler.abort(0)
    assert allocator.free_blocks == 8


async def test_greedy_replies_are_identical_with_and_without_speculation(engines):
    plain, spec = engines
    for prompt in PROMPTS:
        assert (await reply(spec, prompt))[0] == (await reply(plain, prompt))[0]
    assert spec.scheduler_stats().kv.used_blocks == 0  # nothing leaked by rejected drafts


async def test_concurrent_speculative_replies_match_their_plain_replies(engines):
    plain, spec = engines
    both = await asyncio.gather(*(reply(spec, p, max_tokens=60) for p in PROMPTS))
    for prompt, (text, _) in zip(PROMPTS, both, strict=True):
        assert text == (await reply(plain, prompt, max_tokens=60))[0]


async def test_a_stop_sequence_inside_an_accepted_draft_still_ends_the_reply(engines):
    plain, spec = engines
    # The reply loops on "Ammon, and the children of Ammon, ...": the start of the stop arrives
    # in a step that accepted a whole draft, and it completes in a later step. The engine
    # stops there (the reply pipeline cuts the stop string itself).
    stop = ("of Ammon, and the children",)
    expected, _ = await reply(plain, REPETITIVE, stop=stop)
    text, counts = await reply(spec, REPETITIVE, stop=stop)
    assert text == expected and text.endswith(stop[0]) and text.count(stop[0]) == 1
    assert max(counts) > 1 and sum(counts) < 80  # several tokens per step, cut by the stop


async def test_a_repetitive_prompt_takes_fewer_steps_than_tokens(engines):
    plain, spec = engines
    before = spec.stats().steps
    text, counts = await reply(spec, REPETITIVE, max_tokens=100)
    steps = spec.stats().steps - before
    stats = spec.scheduler_stats()
    assert sum(counts) == 100 and len(counts) < 100 and max(counts) > 1
    assert steps < 100  # prefill is one step; decoding took fewer steps than tokens
    rate = stats.draft_accepted / stats.draft_proposed
    print(
        f"\nprompt lookup: 100 tokens in {steps} steps, {len(counts)} deltas, "
        f"{stats.draft_accepted}/{stats.draft_proposed} draft tokens accepted ({rate:.0%})"
    )
    assert text == (await reply(plain, REPETITIVE, max_tokens=100))[0]


async def test_a_stop_string_inside_a_step_lists_the_log_probabilities_plain_decoding_does(engines):
    # A step that accepts a draft makes several tokens; when a stop string begins and ends
    # among them, the tokens of the stop string itself are not the text's: the log
    # probabilities and the usage are those of the same reply made one token at a time.
    plain, spec = engines
    ask = {
        "model": "tiny",
        "prompt": REPETITIVE,
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 1,
        "stop": ["ildren of"],
    }
    answers = []
    for engine in (plain, spec):
        async with (
            running(create_app(engine)) as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
        ):
            whole = await client.completions.create(**ask)  # type: ignore[call-overload]
            chunks = [c async for c in await client.completions.create(**ask, stream=True)]  # type: ignore[call-overload]
        streamed = [
            token
            for chunk in chunks
            if chunk.choices and chunk.choices[0].logprobs is not None
            for token in chunk.choices[0].logprobs.tokens or []
        ]
        assert whole.choices[0].logprobs is not None
        assert streamed == whole.choices[0].logprobs.tokens
        answers.append((whole.choices[0].text, streamed, whole.usage))
    assert answers[1] == answers[0]
    assert answers[0][0] == " Ammon, and the ch"
    assert answers[0][1] == [" Ammon", ",", " and", " the", " children"]


def test_drafts_leave_every_running_sequence_its_token_of_the_step():
    # Four replies decode together on a budget of 12; each has a 3-token draft to verify.
    # Drafts that took the whole budget would leave the newest reply without a token, step
    # after step, for as long as the older ones keep repeating themselves.
    allocator = BlockAllocator(num_blocks=32, block_size=4)
    scheduler = Scheduler(allocator, SchedulerConfig(token_budget=12, spec_tokens=4))
    prompts = {i: [10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(4)}
    for seq_id, prompt in prompts.items():
        scheduler.add(seq_id, prompt, max_new=40)
    prefill = scheduler.schedule()
    assert [c.seq_id for c in prefill.chunks] == [0, 1, 2, 3]
    # Each reply begins with its prompt's first token: "a b c a" drafts "b c a".
    scheduler.record(prefill, {i: prompts[i][0] for i in prompts})
    for _ in range(5):
        step = scheduler.schedule()
        assert [c.seq_id for c in step.chunks] == [0, 1, 2, 3]
        assert step.num_tokens <= 12
        assert any(c.draft for c in step.chunks)
        scheduler.record(step, {c.seq_id: [*c.tokens[1:], c.tokens[0]] for c in step.chunks})
