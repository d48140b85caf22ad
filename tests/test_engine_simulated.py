import asyncio

import pytest

from replystream.engine import (
    EngineError,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
    SimulatedConfig,
    SimulatedEngine,
)
from replystream.engine.simulated import DEFAULT_REPLY, reply_of_length, split_words


def request(seed: int | None = None, max_tokens: int | None = None, prompt: str = ""):
    return GenerationRequest(prompt, SamplingParams(seed=seed, max_tokens=max_tokens))


def test_default_reply_is_120_word_tokens():
    assert len(split_words(DEFAULT_REPLY)) == 120


def test_schedule_is_deterministic_for_a_seed_and_differs_across_seeds():
    engine = SimulatedEngine()
    assert engine.schedule(request(seed=7)) == engine.schedule(request(seed=7))
    assert engine.schedule(request(seed=7)) != engine.schedule(request(seed=8))
    # Without a request seed the engine's own seed (42) is used.
    assert engine.schedule(request()) == engine.schedule(request(seed=42))


def test_schedule_delays_stay_within_jitter_of_the_mean():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=33, jitter_ms=8))
    due = engine.schedule(request())
    steps = [b - a for a, b in zip([0.0, *due], due, strict=False)]
    assert len(steps) == 120
    assert all(0.025 - 1e-9 <= s <= 0.041 + 1e-9 for s in steps)
    assert 0.030 < sum(steps) / len(steps) < 0.036


def test_time_before_first_token_grows_with_prompt_length():
    engine = SimulatedEngine(SimulatedConfig(first_token_ms=100, prefill_ms_per_token=2))
    short = engine.schedule(request(prompt="one two"))[0]
    long = engine.schedule(request(prompt=" ".join(["w"] * 50)))[0]
    assert long - short == pytest.approx(0.096, abs=1e-9)
    assert short >= 0.104 - 1e-9


async def test_tokens_follow_the_fixed_schedule_without_drift():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=10, jitter_ms=3))
    loop = asyncio.get_running_loop()
    start = loop.time()
    deltas = await engine.start(request())
    arrivals = [loop.time() - start async for _ in deltas]
    due = engine.schedule(request())
    # Never early, and the last token is not late by the sum of every timer's lateness.
    assert all(a >= d - 0.002 for a, d in zip(arrivals, due, strict=True))
    assert arrivals[-1] - due[-1] < 0.5
    assert engine.stats().finished == 1


async def test_reply_text_and_finish_reasons():
    engine = SimulatedEngine(SimulatedConfig(reply_text="one two three", delay_ms=1, jitter_ms=0))
    full = [d async for d in await engine.start(request())]
    assert "".join(d.text for d in full) == "one two three "
    assert [d.finish_reason for d in full] == [None, None, "stop"]
    cut = [d async for d in await engine.start(request(max_tokens=2))]
    assert [d.finish_reason for d in cut] == [None, "length"]


async def test_closing_the_stream_stops_generation():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=5, jitter_ms=0))
    deltas = await engine.start(request())
    for _ in range(3):
        await anext(deltas)
    await deltas.aclose()
    steps = engine.stats().steps
    await asyncio.sleep(0.1)
    stats = engine.stats()
    assert stats.steps == steps == 3
    assert (stats.cancelled, stats.active, stats.finished) == (1, 0, 0)


async def test_cancelling_the_reader_task_stops_generation():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=5, jitter_ms=0))

    async def read_all() -> None:
        async for _ in await engine.start(request()):
            pass

    task = asyncio.create_task(read_all())
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    steps = engine.stats().steps
    await asyncio.sleep(0.1)
    assert engine.stats().steps == steps < 120
    assert engine.stats().cancelled == 1


async def test_injected_failures_before_and_after_the_first_token():
    with pytest.raises(EngineError):
        await SimulatedEngine(SimulatedConfig(fail_after=0)).start(request())
    engine = SimulatedEngine(SimulatedConfig(delay_ms=1, jitter_ms=0, fail_after=4))
    got = []
    with pytest.raises(EngineError):
        async for delta in await engine.start(request()):
            got.append(delta)
    assert len(got) == 4
    assert engine.stats().failed == 1


async def test_invalid_requests_and_configs_are_refused():
    with pytest.raises(RequestRejected):
        await SimulatedEngine().start(request(max_tokens=0))
    with pytest.raises(ValueError):
        SimulatedConfig(delay_ms=5, jitter_ms=6)
    with pytest.raises(ValueError):
        SimulatedConfig(reply_text="   ")


def test_reply_of_length_cuts_and_repeats():
    assert reply_of_length("a b c", 2) == "a b"
    assert reply_of_length("a b", 5) == "a b a b a"
