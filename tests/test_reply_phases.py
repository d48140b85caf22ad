"""The reply's phase table and its endings table, and a real ``Reply`` held to both.

The tables are checked as data (every pair of phase and event is allowed, ignored or
refused; the legal paths are exactly the ones written here), then a ``Reply`` with its real
pipeline, memory store and manager is driven through each path and each way of ending, and
what it logged and counted is compared with the row of ``ENDINGS`` for that way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import pytest

from replystream.delivery.formats import NativeFormat
from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogEntry, MemoryReplayStore, ReplyInfo
from replystream.engine.base import Delta, DeltaSink, EngineError
from replystream.server.metrics import Metrics, ReplyRecord
from replystream.server.replies import Reply, ReplyManager
from replystream.server.reply_endings import ENDINGS, Ending, Way
from replystream.server.reply_phases import (
    IGNORED,
    TRANSITIONS,
    Event,
    IllegalTransition,
    Phase,
    next_phase,
)

# Every path from NEW to ENDED the table allows, each step taken at most once.
LEGAL_PATHS = {
    # An engine that pushes its deltas.
    (Event.ATTACHED, Event.ENDED, Event.CONCLUDED),
    # A producer task that runs, then production ends.
    (Event.SPAWNED, Event.TASK_RUNS, Event.ENDED, Event.CONCLUDED),
    # Stopped before its task ran: the task still runs, to close the stream and conclude.
    (Event.SPAWNED, Event.ENDED, Event.TASK_RUNS, Event.CONCLUDED),
}


def paths_from(phase: Phase, used: frozenset[tuple[Phase, Event]]) -> set[tuple[Event, ...]]:
    if phase is Phase.ENDED:
        return {()}
    found: set[tuple[Event, ...]] = set()
    for (source, event), target in TRANSITIONS.items():
        if source is phase and (source, event) not in used:
            for rest in paths_from(target, used | {(source, event)}):
                found.add((event, *rest))
    return found


def test_every_pair_of_phase_and_event_is_allowed_ignored_or_refused() -> None:
    assert not set(TRANSITIONS) & IGNORED
    for phase in Phase:
        for event in Event:
            if (phase, event) in TRANSITIONS:
                assert next_phase(phase, event) is TRANSITIONS[phase, event]
            elif (phase, event) in IGNORED:
                assert next_phase(phase, event) is None
            else:
                with pytest.raises(IllegalTransition) as refused:
                    next_phase(phase, event)
                assert (refused.value.phase, refused.value.event) == (phase, event)


def test_the_legal_paths_from_new_to_ended_are_exactly_these() -> None:
    assert paths_from(Phase.NEW, frozenset()) == LEGAL_PATHS


def test_ended_is_final_and_every_phase_can_reach_it() -> None:
    assert not [key for key in TRANSITIONS if key[0] is Phase.ENDED]
    for phase in Phase:
        assert paths_from(phase, frozenset()), f"{phase} cannot reach ENDED"


@pytest.mark.parametrize(
    ("phase", "event"),
    [
        (Phase.NEW, Event.ENDED),  # stopped before it began
        (Phase.PRODUCING, Event.ATTACHED),  # begun twice
        (Phase.PRODUCING, Event.CONCLUDED),  # concluded before its ending was decided
        (Phase.ENDED, Event.CONCLUDED),  # concluded twice
        (Phase.ENDED, Event.TASK_RUNS),
        (Phase.STOPPING, Event.TASK_RUNS),  # a pushed reply's, or a second run
        (Phase.STOPPED_EARLY, Event.CONCLUDED),  # concluded without its task's cleanup
    ],
)
def test_a_transition_the_table_does_not_name_is_refused(phase: Phase, event: Event) -> None:
    with pytest.raises(IllegalTransition):
        next_phase(phase, event)


def test_a_stop_once_the_ending_is_decided_is_ignored_not_refused() -> None:
    assert IGNORED == {
        (Phase.STOPPED_EARLY, Event.ENDED),
        (Phase.STOPPING, Event.ENDED),
        (Phase.ENDED, Event.ENDED),
    }


# A real Reply, with its real pipeline, memory store and manager; only the engine is ours.


class PushStream:
    """A pushing engine stream the test drives: deltas and the end go to the sink it got."""

    def __init__(self) -> None:
        self.sink: DeltaSink | None = None
        self.closed = False

    def __aiter__(self) -> PushStream:
        return self

    async def __anext__(self) -> Delta:
        raise AssertionError("a pushed stream is never iterated")

    async def aclose(self) -> None:
        self.close()

    def attach(self, sink: DeltaSink) -> None:
        self.sink = sink

    def close(self) -> None:
        self.closed = True


class PullStream:
    """A pulled stream: yields ``texts``, then raises ``error`` or waits for ``release``."""

    def __init__(self, texts: Sequence[str] = (), error: Exception | None = None) -> None:
        self.texts = list(texts)
        self.error = error
        self.release = asyncio.Event()
        self.pulled = 0
        self.closed = False

    def __aiter__(self) -> PullStream:
        return self

    async def __anext__(self) -> Delta:
        await asyncio.sleep(0)
        if self.texts:
            self.pulled += 1
            return Delta(self.texts.pop(0), 1, time.monotonic())
        if self.error is not None:
            raise self.error
        await self.release.wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


class FailingStore(MemoryReplayStore):
    """A memory store whose appends report a failure, as a Redis store does when Redis dies."""

    def failure(self, reply_id: str) -> str | None:
        return "connection refused"


async def make_reply(
    deltas: PushStream | PullStream,
    *,
    store: MemoryReplayStore | None = None,
    policy: DeliveryPolicy | None = None,
) -> Reply:
    store = store or MemoryReplayStore()
    await store.create(ReplyInfo("r1"))
    return Reply(
        reply_id="r1",
        deltas=deltas,
        pipeline=ReplyPipeline(NativeFormat(), policy or DeliveryPolicy()),
        store=store,
        record=ReplyRecord("test", streamed=True),
        prompt_tokens=1,
        disconnect="cancel",
        detach_grace_s=1.0,
        manager=ReplyManager(Metrics()),
        resumable=True,  # keep the log after the end, to read it
        pushes=isinstance(deltas, PushStream),
    )


def phase_of(reply: Reply) -> Phase:
    """Read afresh each time (mypy would take a property read twice for the same value)."""
    return reply.phase


async def last_event(reply: Reply) -> tuple[str, dict[str, object], str | None]:
    """The reply log's last event (type, data) and its terminal entry."""
    result = await reply.store.read(reply.reply_id, 0, 0.0)
    assert result is not None
    last = result.entries[-1]
    return last.event or "message", json.loads(last.data), result.ending


async def test_a_pushed_reply_goes_from_new_through_producing_to_ended() -> None:
    stream = PushStream()
    reply = await make_reply(stream)
    assert phase_of(reply) is Phase.NEW and not reply.live
    reply.manager.start(reply)
    assert phase_of(reply) is Phase.PRODUCING and reply.live
    assert stream.sink is reply
    reply.on_deltas([Delta("hello", 1, time.monotonic())])
    reply.on_end(None)
    assert phase_of(reply) is Phase.ENDED and not reply.live
    assert stream.closed
    assert (await last_event(reply))[0] == "done"


async def test_a_pulled_reply_goes_through_starting_and_producing_to_ended() -> None:
    stream = PullStream(["a", "b"])
    reply = await make_reply(stream)
    reply.manager.start(reply)
    assert phase_of(reply) is Phase.STARTING and reply.live
    await asyncio.sleep(0)
    assert phase_of(reply) is Phase.PRODUCING
    stream.release.set()
    assert reply.task is not None
    await asyncio.wait_for(reply.task, 5.0)
    assert phase_of(reply) is Phase.ENDED
    assert stream.pulled == 2 and stream.closed
    assert reply.record.outcome == "finished"


async def test_a_reply_stopped_before_its_task_runs_still_closes_its_stream_and_concludes() -> None:
    stream = PullStream(["never pulled"])
    reply = await make_reply(stream)
    reply.manager.start(reply)
    reply.stop("client_gone")
    reply.stop("shutdown")  # too late: the ending is decided
    assert phase_of(reply) is Phase.STOPPED_EARLY and reply.live
    assert reply.task is not None
    await asyncio.wait_for(reply.task, 5.0)
    assert phase_of(reply) is Phase.ENDED
    assert stream.pulled == 0 and stream.closed
    assert (reply.record.outcome, reply.record.reason) == ("cancelled", "client_gone")


async def test_a_pushed_reply_stopped_ends_in_the_next_loop_turn_with_the_first_reason() -> None:
    stream = PushStream()
    reply = await make_reply(stream)
    reply.manager.start(reply)
    reply.stop("slow_client")
    assert phase_of(reply) is Phase.STOPPING and stream.closed
    reply.stop("shutdown")  # too late: the ending is decided
    reply.on_end(EngineError("late", code="late"))  # the engine's word after the stop
    reply.on_deltas([Delta("late text", 1, time.monotonic())])  # dropped
    await asyncio.sleep(0)
    assert phase_of(reply) is Phase.ENDED
    assert (reply.record.outcome, reply.record.reason) == ("slow_client", "slow_client")
    kind, data, _ = await last_event(reply)
    assert (kind, data["error"]) == (
        "error",
        {"message": "reply stopped: slow_client", "code": "cancelled"},
    )


class EndsInAttach(PushStream):
    """A pushed stream with all of its reply at hand: it ends inside ``attach``."""

    def attach(self, sink: DeltaSink) -> None:
        super().attach(sink)
        sink.on_deltas([Delta("all", 1, time.monotonic())])
        sink.on_end(None)


async def test_a_reply_ended_inside_attach_concludes_in_the_next_turn_without_a_reader() -> None:
    reply = await make_reply(EndsInAttach())
    reply.manager.start(reply)
    assert phase_of(reply) is Phase.STOPPING  # its log is there for the reader to come
    await asyncio.sleep(0)
    assert phase_of(reply) is Phase.ENDED
    assert (await last_event(reply))[0] == "done"


async def test_a_reply_ended_inside_attach_concludes_once_its_reader_sent_its_first_events() -> (
    None
):
    failures: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: failures.append(context))
    reply = await make_reply(EndsInAttach())
    reply.manager.start(reply)
    reply.reader_joined()
    reply.consumed(reply.last_seq)
    # Concluded before the turn ends: the reader finds the last events at its next look.
    assert phase_of(reply) is Phase.ENDED
    assert reply.record.outcome == "finished"
    assert (await last_event(reply))[0] == "done"
    await asyncio.sleep(0)  # the conclusion put off to this turn does not come again
    await asyncio.sleep(0)
    assert failures == []
    assert phase_of(reply) is Phase.ENDED


async def test_a_stop_after_the_reply_ended_changes_nothing() -> None:
    reply = await make_reply(PushStream())
    reply.manager.start(reply)
    reply.on_end(None)
    reply.stop("shutdown")
    assert phase_of(reply) is Phase.ENDED
    assert reply.record.outcome == "finished"


async def test_concluding_a_reply_twice_is_refused() -> None:
    reply = await make_reply(PushStream())
    reply.manager.start(reply)
    reply.on_end(None)
    with pytest.raises(IllegalTransition):
        reply._conclude()


async def end_by(way: Way) -> Reply:
    """A reply ended the way ``way`` names, by the means that way is reached in service."""
    if way == "internal_error":
        reply = await make_reply(PullStream(["a"], error=ValueError("a bug")))
        reply.manager.start(reply)
        assert reply.task is not None
        await asyncio.wait_for(reply.task, 5.0)
        return reply
    store = FailingStore() if way == "store_failure" else None
    policy = (
        DeliveryPolicy(holdback_tokens=4, checks=(BannedPhrases(["forbidden"]),))
        if way == "moderated"
        else None
    )
    reply = await make_reply(PushStream(), store=store, policy=policy)
    reply.manager.start(reply)
    if way in ("finished", "moderated", "store_failure"):
        reply.on_deltas([Delta("this is forbidden", 1, time.monotonic())])
        if way == "finished":
            reply.on_end(None)
    elif way == "engine_error":
        reply.on_end(EngineError("the model fell over", code="model_down"))
    else:
        reply.stop(way)  # type: ignore[arg-type]
        await asyncio.sleep(0)
    return reply


# What each way's ``{detail}`` and ``{code}`` are, as ``end_by`` reaches it.
WORDS: dict[str, Ending] = {
    "moderated": Ending("moderated", "banned_phrase"),
    "engine_error": Ending("engine_error", "the model fell over", "model_down"),
    "store_failure": Ending("store_failure", "the reply store is unavailable: connection refused"),
    "internal_error": Ending("internal_error", "ValueError"),
}


@pytest.mark.parametrize("way", list(ENDINGS))
async def test_each_way_of_ending_logs_counts_and_says_what_its_row_says(way: Way) -> None:
    reply = await end_by(way)
    rule, words = ENDINGS[way], WORDS.get(way, Ending(way))
    assert phase_of(reply) is Phase.ENDED
    assert reply.record.outcome == rule.outcome
    assert reply.record.reason == words.fill(rule.reason)
    kind, data, log_end = await last_event(reply)
    assert log_end == rule.log_end
    expected_kind = {"end marker": "done", "moderated": "moderated", "error": "error"}
    assert kind == expected_kind[rule.in_band]
    if rule.in_band == "error":
        assert data["error"] == {"message": words.fill(rule.message), "code": words.fill(rule.code)}
    assert reply.manager.get(reply.reply_id) is None


async def test_an_engine_error_from_a_pulled_stream_ends_as_an_engine_error() -> None:
    reply = await make_reply(PullStream(["a"], error=EngineError("gone", code="upstream_gone")))
    reply.manager.start(reply)
    assert reply.task is not None
    await asyncio.wait_for(reply.task, 5.0)
    assert (reply.record.outcome, reply.record.reason) == ("errored", "upstream_gone")


class SlowSink:
    """A reader on the direct path that falls behind on the first events pushed to it."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.pushed = 0

    def push(self, entries: list[LogEntry]) -> None:
        self.pushed += len(entries)
        self.reply.reader_fell_behind()

    def wake(self) -> None:
        return None


async def test_a_pulled_reply_cut_inside_its_own_append_pulls_no_more_and_ends_slow() -> None:
    stream = PullStream(["one", "two", "three"])
    reply = await make_reply(stream)
    reply.manager.start(reply)
    reply.reader_joined()
    reply.sinks.append(SlowSink(reply))
    stream.release.set()
    assert reply.task is not None
    await asyncio.wait_for(reply.task, 5.0)
    assert stream.pulled == 1 and stream.closed
    assert (reply.record.outcome, reply.record.reason) == ("slow_client", "slow_client")
    assert phase_of(reply) is Phase.ENDED
