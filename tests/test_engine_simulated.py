import asyncio
import time

import pytest

from replystream.engine import (
    EngineError,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
    SimulatedConfig,
    SimulatedEngine,
    simulated,
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


def hold_the_loop(seconds: float) -> None:
    """Keep the event loop busy, as an overloaded server does, so tokens come due together."""
    time.sleep(seconds)


class RecordingSink:
    """Records each push: the texts delivered together, and how the stream ended."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.ended = asyncio.Event()
        self.error: EngineError | None = None

    def on_deltas(self, deltas) -> None:
        self.calls.append([delta.text for delta in deltas])

    def on_end(self, error: EngineError | None) -> None:
        self.error = error
        self.ended.set()


async def attached(engine: SimulatedEngine, seed: int = 1) -> RecordingSink:
    sink = RecordingSink()
    (await engine.start(request(seed=seed))).attach(sink)
    return sink


async def test_attached_stream_pushes_the_same_tokens_as_iteration():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=2, jitter_ms=1))
    iterated = [delta.text async for delta in await engine.start(request(seed=3))]
    sink = await attached(engine, seed=3)
    await asyncio.wait_for(sink.ended.wait(), 10)
    assert [text for call in sink.calls for text in call] == iterated
    assert sink.error is None
    assert engine.stats().finished == 2 and engine.stats().active == 0


async def test_overdue_tokens_of_a_stream_arrive_in_one_push_in_order():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=5, jitter_ms=0))
    sink = await attached(engine)
    hold_the_loop(0.2)  # about 40 tokens come due meanwhile
    await asyncio.wait_for(sink.ended.wait(), 10)
    assert len(sink.calls[0]) >= 20, "the overdue tokens should leave in one push"
    assert [text for call in sink.calls for text in call] == split_words(DEFAULT_REPLY)


async def test_a_failure_due_among_overdue_tokens_comes_after_the_tokens_before_it():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=2, jitter_ms=0, fail_after=7))
    sink = await attached(engine)
    hold_the_loop(0.1)  # all of them overdue, the failure among them
    await asyncio.wait_for(sink.ended.wait(), 10)
    assert sum(map(len, sink.calls)) == 7
    assert isinstance(sink.error, EngineError)
    assert engine.stats().failed == 1 and engine.stats().active == 0


async def test_one_tick_delivers_a_bounded_number_of_overdue_tokens():
    from replystream.engine.simulated import TOKENS_PER_TICK

    engine = SimulatedEngine(SimulatedConfig(delay_ms=1, jitter_ms=0))
    sinks = [await attached(engine, seed) for seed in range(10)]  # 1,200 tokens in all
    hold_the_loop(0.3)  # every token of every stream is overdue
    delivered_per_turn: list[int] = []
    while not all(sink.ended.is_set() for sink in sinks):
        before = sum(len(call) for sink in sinks for call in sink.calls)
        await asyncio.sleep(0)  # one turn of the loop: at most one tick
        delivered_per_turn.append(sum(len(c) for s in sinks for c in s.calls) - before)
    assert max(delivered_per_turn) <= TOKENS_PER_TICK
    assert all(sum(map(len, sink.calls)) == 120 for sink in sinks)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_attached_streams_wait_for_their_tokens_without_spinning_the_loop(
    loop_name: str, monkeypatch: pytest.MonkeyPatch
):
    # uvloop's millisecond timers fire up to a millisecond early; a ticker that re-arms for
    # a token not quite due spins the loop at full CPU until it is: a tick after a tick,
    # each delivering nothing. Counted, not timed: the CPU that waiting costs depends on the
    # machine (2 % of a core on one, 7-8 % on another), a spin's count of ticks does not.
    ticks = 0
    tick = simulated._Ticker._tick

    def counted(self: simulated._Ticker) -> None:
        nonlocal ticks
        ticks += 1
        tick(self)

    monkeypatch.setattr(simulated._Ticker, "_tick", counted)
    if loop_name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    else:
        runner = asyncio.Runner()

    async def stream_one() -> tuple[int, float, float]:
        engine = SimulatedEngine(SimulatedConfig(delay_ms=3, jitter_ms=0.5))
        sink = await attached(engine)
        # Only the wait is timed: not the loop's start, nor the stream's. The loop's own
        # thread's CPU: threads other tests left in this process (BLAS, runners) are not its.
        wall, cpu = time.monotonic(), time.thread_time()
        await asyncio.wait_for(sink.ended.wait(), 10)
        return sum(map(len, sink.calls)), time.monotonic() - wall, time.thread_time() - cpu

    with runner:
        tokens, wall, cpu = runner.run(stream_one())
    assert tokens == 120  # about 0.36 s of waiting
    assert ticks <= 2 * tokens, f"{ticks} ticks for {tokens} tokens"
    # And nothing else spins at full CPU: waiting is a few per cent of a core.
    assert cpu < 0.3 * wall, f"{cpu:.3f} s of CPU in {wall:.2f} s of waiting"
