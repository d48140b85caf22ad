"""TinyEngine end to end: seeded replies, limits, rejections, cancellation, timings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from replystream.engine.base import (
    Delta,
    Engine,
    EngineError,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
)
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig

PROMPT = "And the LORD spake unto Moses, saying,"


@pytest.fixture
async def engine() -> AsyncIterator[TinyEngine]:
    engine = load_default_engine()
    try:
        yield engine
    finally:
        await engine.aclose()


async def reply(engine: TinyEngine, prompt: str = PROMPT, **sampling: object) -> list[Delta]:
    stream = await engine.start(GenerationRequest(prompt, SamplingParams(**sampling)))  # type: ignore[arg-type]
    return [delta async for delta in stream]


async def collect(stream: AsyncIterator[Delta]) -> list[Delta]:
    return [delta async for delta in stream]


def text(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


async def wait_for(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll ``condition``: it turns true on the engine's worker thread, not on an event."""
    async with asyncio.timeout(within_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def test_tiny_engine_is_an_engine(engine: TinyEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.name == "tiny"
    assert engine.count_tokens(PROMPT) > 5


async def test_same_seed_gives_the_same_reply(engine: TinyEngine) -> None:
    a = await reply(engine, max_tokens=30, temperature=0.9, top_p=0.95, seed=11)
    b = await reply(engine, max_tokens=30, temperature=0.9, top_p=0.95, seed=11)
    c = await reply(engine, max_tokens=30, temperature=0.9, top_p=0.95, seed=12)
    assert text(a) == text(b)
    assert text(a) != text(c)


async def test_greedy_reply_is_words(engine: TinyEngine) -> None:
    deltas = await reply(engine, max_tokens=40, temperature=0)
    words = text(deltas).split()
    assert len(words) >= 10
    assert sum(w.strip(".,;:").isalpha() for w in words) >= len(words) * 0.8


async def test_max_tokens_ends_with_length_on_the_last_delta(engine: TinyEngine) -> None:
    deltas = await reply(engine, max_tokens=9, seed=3)
    assert len(deltas) == 9
    assert [d.finish_reason for d in deltas] == [None] * 8 + ["length"]
    assert all(d.tokens == 1 for d in deltas)
    assert engine.stats().finished == 1 and engine.stats().active == 0


async def test_a_stop_sequence_ends_generation_where_it_completes(engine: TinyEngine) -> None:
    # The engine stops making tokens; cutting the stop string is the reply pipeline's job.
    full = text(await reply(engine, max_tokens=40, temperature=0))
    words = full.split()
    stop = " " + words[len(words) // 2]
    deltas = await reply(engine, max_tokens=40, temperature=0, stop=(stop,))
    assert text(deltas) == full[: full.index(stop) + len(stop)]
    assert deltas[-1].finish_reason == "stop"
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_a_reply_never_runs_past_the_context(engine: TinyEngine) -> None:
    context = engine.model.config.context
    prompt = "word " * 250
    n = engine.count_tokens(prompt)
    deltas = await reply(engine, prompt, max_tokens=1000, temperature=0)
    assert len(deltas) == context - n
    assert deltas[-1].finish_reason == "length"


async def test_a_prompt_longer_than_the_context_is_rejected(engine: TinyEngine) -> None:
    with pytest.raises(RequestRejected) as caught:
        await engine.start(GenerationRequest("amen " * 400))
    assert caught.value.param == "prompt"
    assert caught.value.code == "context_length_exceeded"


async def test_a_pool_smaller_than_the_default_reply_caps_it_and_refuses_what_it_cannot_hold():
    engine = load_default_engine(TinyEngineConfig(num_blocks=4, block_size=16))  # 64 tokens
    n = engine.count_tokens(PROMPT)
    try:
        deltas = await reply(engine, temperature=0)  # no max_tokens: the default, 128
        # The last token made is never run, so it needs no slot: 64 - n + 1 tokens fit.
        assert sum(d.tokens for d in deltas) == 64 - n + 1
        assert deltas[-1].finish_reason == "length"
        with pytest.raises(RequestRejected) as too_long:
            await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=100)))
        assert too_long.value.param == "max_tokens"
        assert f"at most {64 - n + 1}" in str(too_long.value)
        with pytest.raises(RequestRejected) as huge_prompt:
            await engine.start(GenerationRequest("amen " * 40, SamplingParams(max_tokens=1)))
        assert huge_prompt.value.param == "prompt"
        assert huge_prompt.value.code == "context_length_exceeded"
        assert engine.scheduler_stats().kv.used_blocks == 0
    finally:
        await engine.aclose()


async def test_bad_sampling_values_are_rejected_before_any_token(engine: TinyEngine) -> None:
    with pytest.raises(RequestRejected) as caught:
        await engine.start(GenerationRequest(PROMPT, SamplingParams(top_p=2.0)))
    assert caught.value.param == "top_p"
    assert engine.stats().started == 0


async def test_empty_prompt_starts_a_new_paragraph(engine: TinyEngine) -> None:
    deltas = await reply(engine, "", max_tokens=5, temperature=0)
    assert len(deltas) == 5


async def test_closed_stream_leaves_the_batch_at_the_next_step_and_frees_blocks(
    engine: TinyEngine,
) -> None:
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=200, seed=1))
    kept = await engine.start(request)
    closed = await engine.start(request)
    await anext(kept)
    await anext(closed)
    two = engine.scheduler_stats()
    assert two.running == 2
    await closed.aclose()
    await wait_for(lambda: engine.stats().cancelled == 1)
    one = engine.scheduler_stats()
    assert one.running == 1 and one.aborted == 1
    assert (two.kv.sequences, one.kv.sequences) == (2, 1)  # only the kept one holds blocks
    assert closed.request_id not in engine.runner.cache.allocator
    await kept.aclose()
    await wait_for(lambda: engine.scheduler_stats().running == 0)
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_cancelling_the_reading_task_aborts_the_request(engine: TinyEngine) -> None:
    stream = await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=200)))
    first = asyncio.Event()

    async def read() -> None:
        try:
            async for _ in stream:
                first.set()
        finally:
            await stream.aclose()

    async with asyncio.TaskGroup() as group:
        task = group.create_task(read())
        await first.wait()
        task.cancel()
    await wait_for(lambda: engine.stats().cancelled == 1)
    timings = engine.timings(stream.request_id)
    assert timings is not None and timings.finish_reason == "cancelled"
    assert 0 < len(timings.tokens) < 200
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_timings_record_queue_schedule_and_every_token(engine: TinyEngine) -> None:
    stream = await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=6)))
    deltas = [d async for d in stream]
    t = engine.timings(stream.request_id)
    assert t is not None and t.scheduled is not None and t.first_token is not None
    assert t.queued <= t.scheduled <= t.first_token == t.tokens[0]
    assert list(t.tokens) == sorted(t.tokens) and len(t.tokens) == 6
    assert [d.made_at for d in deltas] == list(t.tokens)
    assert t.finish_reason == "length" and t.preempted == ()


async def test_a_small_pool_preempts_and_still_finishes_every_reply() -> None:
    engine = load_default_engine(TinyEngineConfig(num_blocks=10, block_size=16))
    try:
        streams = [
            await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=60, seed=i)))
            for i in range(4)
        ]
        replies = await asyncio.gather(*(collect(s) for s in streams))
        assert [len(r) for r in replies] == [60] * 4
        stats = engine.scheduler_stats()
        assert stats.preemptions > 0 and stats.kv.used_blocks == 0
        preempted = [engine.timings(s.request_id) for s in streams]
        assert any(t is not None and t.preempted for t in preempted)
    finally:
        await engine.aclose()


async def test_aclose_ends_open_streams_with_an_error() -> None:
    engine = load_default_engine()
    stream = await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=250)))
    await anext(stream)
    await engine.aclose()
    with pytest.raises(EngineError, match="closed"):
        async for _ in stream:
            pass
    assert engine.stats().active == 0
    # Cancelled after the worker ended (it alone touches the scheduler while it lives):
    # nothing is left in the KV pool.
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_a_failing_step_ends_every_stream_with_an_engine_error(
    engine: TinyEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: object) -> None:
        raise FloatingPointError("secret internals")

    monkeypatch.setattr(engine.model, "forward", broken)
    stream = await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=5)))
    with pytest.raises(EngineError) as failed:
        await anext(stream)
    # The client is told the model failed, never the exception's text; the log has it all.
    assert str(failed.value) == "the model failed while generating (the server log says why)"
    [record] = [r for r in caplog.records if r.name == "replystream.engine"]
    assert record.exc_info is not None and "secret internals" in str(record.exc_info[1])
    stats = engine.stats()
    assert (stats.failed, stats.active) == (1, 0)
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_start_after_aclose_is_an_engine_error() -> None:
    engine = load_default_engine()
    await engine.aclose()
    with pytest.raises(EngineError, match="closed"):
        await engine.start(GenerationRequest(PROMPT))


async def test_closing_a_stream_before_reading_it_aborts_the_request(engine: TinyEngine) -> None:
    stream = await engine.start(GenerationRequest(PROMPT, SamplingParams(max_tokens=250)))
    await stream.aclose()
    await wait_for(lambda: engine.stats().active == 0)
    assert engine.stats().cancelled == 1
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_closing_a_finished_stream_counts_no_step_the_model_did_not_run() -> None:
    """Closing a stream that already finished asks the worker to abort a request it no longer
    has: the step that applies it plans nothing and runs nothing, and neither the engine's nor
    the scheduler's step count may grow for it (they are the same count)."""
    engine = load_default_engine()
    runner = engine.runner  # stepped by hand here: no worker thread, no race with it
    request_id, queue = runner.submit(engine.tokenizer.encode(PROMPT), 3, SamplingParams(seed=1))
    for _ in range(3):  # a prefill that samples the first token, then two decode steps
        runner.step()
    assert not runner.scheduler.has_work()
    assert runner.stats().steps == runner.scheduler_stats().steps == 3
    runner.abort(request_id)  # what closing the finished stream does
    runner.step()
    assert runner.stats().steps == runner.scheduler_stats().steps == 3
    await asyncio.sleep(0)  # the deltas were handed to the loop: all three arrived
    deltas = [queue.get_nowait() for _ in range(3)]
    assert [d.finish_reason for d in deltas if isinstance(d, Delta)] == [None, None, "length"]
