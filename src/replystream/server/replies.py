"""Replies in flight: each one's producer task, its readers, and how it stops.

A reply's producer runs in a task owned by the ``ReplyManager``, not by the connection that
asked for it: it feeds the engine's deltas through the ``ReplyPipeline`` into the reply log,
where any reader (the first connection, or a resume on any replica) follows it.
Disconnect policies: ``cancel`` stops generation when the last local reader leaves (the
default for replies nobody can resume); ``detach`` keeps generating for a grace period so a
client can come back, and stops if none has by then (the default for resumable replies).
Every producer ends by writing its terminal entry and closing the engine's stream in
``finally``, whatever stopped it. This file must not know about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from replystream.delivery.channel import DeltaChannel, End
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.replay import LogEntry, MemoryReplayStore, ReplayStore
from replystream.engine.base import Delta, DeltaSink, DeltaStream, EngineError
from replystream.server.metrics import Metrics, Outcome, ReplyRecord

log = logging.getLogger("replystream.replies")

Disconnect = Literal["cancel", "detach"]
StopReason = Literal["cancelled", "client_gone", "slow_client", "shutdown", "detach_expired"]


async def close_quietly(deltas: DeltaStream) -> None:
    """Close an engine stream, bounded and shielded, from any exit path."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        async with asyncio.timeout(1.0):
            await asyncio.shield(deltas.aclose())


class LogSink(Protocol):
    """A reader that takes new events straight from the producer (see server.reader)."""

    def push(self, entries: list[LogEntry]) -> None: ...

    def wake(self) -> None: ...


@dataclass(eq=False, slots=True)
class Reply:
    """One reply being generated in this process."""

    reply_id: str
    deltas: DeltaStream
    pipeline: ReplyPipeline
    store: ReplayStore
    record: ReplyRecord
    prompt_tokens: int
    disconnect: Disconnect
    detach_grace_s: float
    manager: ReplyManager
    resumable: bool = False
    readers: int = 0
    stop_reason: StopReason | None = None
    # Lists, not sets: a reply has one reader or a few, and thousands of replies each hold these.
    hooks: list[Callable[[], None]] = field(default_factory=list)
    sinks: list[LogSink] = field(default_factory=list)  # readers the producer writes to directly
    task: asyncio.Task[None] | None = None
    _window_timer: asyncio.TimerHandle | None = None
    _stopping: EngineError | str | None = None  # why production ended ("finished", ...)
    _pushed_done: asyncio.Future[None] | None = None
    _started: bool = False
    _detach_timer: asyncio.TimerHandle | None = None
    # The store, when nobody may resume the reply and its log is in this process: what is
    # sent may then be dropped. Decided once, not on every push.
    _private_log: MemoryReplayStore | None = field(init=False)

    def __post_init__(self) -> None:
        self._private_log = None
        if not self.resumable and isinstance(self.store, MemoryReplayStore):
            self._private_log = self.store

    @property
    def live(self) -> bool:
        return self.task is not None and not self.task.done()

    def stop(self, reason: StopReason) -> None:
        """Stop generating; the producer ends the log with an event that says why."""
        if self.live and self.stop_reason is None:
            self.stop_reason = reason
            # A task cancelled before it first runs never enters ``produce`` (nor its
            # ``finally``); one that has not started sees ``stop_reason`` as it starts.
            if self._started:
                assert self.task is not None
                self.task.cancel()

    def reader_joined(self) -> None:
        self.readers += 1
        if self._detach_timer is not None:
            self._detach_timer.cancel()
            self._detach_timer = None

    def reader_left(self, reason: StopReason) -> None:
        self.readers -= 1
        if not self.live:
            self.forget_if_unwanted()
            return
        if self.readers:
            return
        if self.disconnect == "cancel":
            self.stop(reason)
        elif self._detach_timer is None:
            loop = asyncio.get_running_loop()
            self._detach_timer = loop.call_later(self.detach_grace_s, self._detach_expired)

    def consumed(self, upto: int) -> None:
        """A reader has sent everything up to ``upto``; a reply nobody may resume, with one
        reader, needs none of it again, so its log stops growing with the reply."""
        if self._private_log is not None and self.readers == 1:
            self._private_log.release(self.reply_id, upto)

    def reader_fell_behind(self) -> None:
        """The only reader of a reply nobody may resume is past the slow-client limit: stop
        generating now (its task will cut the connection), so the log stops growing."""
        if self.disconnect == "cancel" and self.readers == 1:
            self.stop("slow_client")

    def forget_if_unwanted(self) -> None:
        """Drop the log of an ended reply nobody may resume, once its last reader is done."""
        if self._private_log is not None and self.readers == 0:
            self._private_log.discard(self.reply_id)

    def _detach_expired(self) -> None:
        self._detach_timer = None
        if self.readers == 0:
            self.stop("detach_expired")

    def _append(self, entries: list[LogEntry]) -> None:
        if entries:
            self.store.append(self.reply_id, entries)
            # Neither a push nor a hook changes these lists (readers leave from their own task).
            for sink in self.sinks:
                sink.push(entries)
            for hook in self.hooks:
                hook()

    def _flush_window(self) -> None:
        self._window_timer = None
        self._append(self.pipeline.flush_due(time.monotonic()))

    def _arm_window(self) -> None:
        due = self.pipeline.batcher.due_at
        if due is not None and self._window_timer is None:
            delay = max(0.0, due - time.monotonic())
            self._window_timer = asyncio.get_running_loop().call_later(delay, self._flush_window)

    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        """Deltas from the engine: through the pipeline into the log (sync, no waiting).
        Deltas that came due together are appended together, so a reader writes them at once.
        """
        if self._stopping is not None or self.stop_reason is not None:
            return
        record, pipeline = self.record, self.pipeline
        now = time.monotonic()
        entries: list[LogEntry] = []
        for delta in deltas:
            record.on_delta(delta.made_at, delta.tokens)
            entries += pipeline.push(delta, now)
            if pipeline.violation is not None:
                break
        self._append(entries)
        if pipeline.violation is not None:
            self._stop_producing("moderated")
            return
        failure = self.store.failure(self.reply_id)
        if failure is not None:
            error = EngineError(f"reply log unavailable: {failure}", code="replay_store_error")
            self._stop_producing(error)
            return
        self._arm_window()

    def on_end(self, error: EngineError | None) -> None:
        """The engine's stream ended (pushed streams only)."""
        self._stop_producing(error if error is not None else "finished")

    def _stop_producing(self, why: EngineError | str) -> None:
        if self._stopping is None:
            self._stopping = why
            if self._pushed_done is not None and not self._pushed_done.done():
                self._pushed_done.set_result(None)

    async def _run_engine(self) -> None:
        """Feed every delta to ``on_deltas`` until the stream ends or the reply stops early."""
        # A PushDeltaStream; asked by attribute, as isinstance against a runtime-checkable
        # protocol costs about 7 us a reply.
        attach: Callable[[DeltaSink], None] | None = getattr(self.deltas, "attach", None)
        if attach is not None:
            # The engine calls on_deltas itself: no wake-up of this task per token.
            self._pushed_done = asyncio.get_running_loop().create_future()
            attach(self)
            await self._pushed_done
        else:
            async for delta in self.deltas:
                self.on_deltas((delta,))
                if self._stopping is not None:
                    break
            else:
                self._stopping = "finished"
        if isinstance(self._stopping, EngineError):
            raise self._stopping

    async def produce(self) -> None:
        """Run the generation into the log until it ends, whatever ends it."""
        pipeline, record = self.pipeline, self.record
        outcome: Outcome = "cancelled"
        ending = "cancelled"
        self._started = True
        try:
            if self.stop_reason is not None:
                raise asyncio.CancelledError  # stopped before it began: end like any stop
            await self._run_engine()
            if self._stopping == "moderated":
                assert pipeline.violation is not None
                outcome, ending = "moderated", "moderated"
                record.reason = pipeline.violation.check
                return
            self._append(pipeline.finish(self.prompt_tokens))
            outcome, ending = "finished", "finished"
        except EngineError as exc:
            log.warning("generation failed: %s", exc)
            self._append(pipeline.fail(str(exc), exc.code))
            outcome, ending, record.reason = "errored", "errored", exc.code
        except asyncio.CancelledError:
            reason = self.stop_reason or "cancelled"
            if reason == "shutdown":
                self._append(pipeline.fail("the server is shutting down", "shutdown"))
                outcome = ending = "shutdown"
            else:
                self._append(pipeline.fail(f"reply stopped: {reason}", "cancelled"))
                outcome = "slow_client" if reason == "slow_client" else "cancelled"
                ending = "cancelled"
            record.reason = reason
            # This task is only ever cancelled through ``stop``; the reply ends here.
        except Exception as exc:
            log.exception("reply producer failed")
            self._append(pipeline.fail(f"internal error: {type(exc).__name__}", "internal_error"))
            outcome = ending = "errored"
        finally:
            for timer in (self._window_timer, self._detach_timer):
                if timer is not None:
                    timer.cancel()
            await close_quietly(self.deltas)
            record.outcome = outcome
            self.store.end(self.reply_id, ending)
            for sink in list(self.sinks):
                sink.wake()
            for hook in list(self.hooks):
                hook()
            self.manager.finished(self)
            self.forget_if_unwanted()


class ReplyManager:
    """Owns every producer task of this process; stops them on shutdown."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.replies: dict[str, Reply] = {}
        self.channels: set[DeltaChannel] = set()  # buffered replies being collected
        self.readers: set[Callable[[], None]] = set()  # interrupt hooks of every open reader
        self.idle = asyncio.Event()
        self.idle.set()
        self.shutting_down = False

    def __len__(self) -> int:
        return len(self.replies) + len(self.channels)

    def track(self, channel: DeltaChannel) -> None:
        self.channels.add(channel)
        self.idle.clear()

    def untrack(self, channel: DeltaChannel) -> None:
        self.channels.discard(channel)
        if not len(self):
            self.idle.set()

    def start(self, reply: Reply) -> None:
        self.replies[reply.reply_id] = reply
        self.idle.clear()
        self.metrics.active.inc()
        # The opening events are logged at once, so the first reader finds them ready and
        # its response headers leave together with them.
        reply._append(reply.pipeline.start(reply.reply_id))
        reply.task = asyncio.get_running_loop().create_task(
            reply.produce(), name=f"reply-{reply.reply_id[:8]}"
        )

    def finished(self, reply: Reply) -> None:
        self.replies.pop(reply.reply_id, None)
        self.metrics.active.dec()
        self.metrics.observe(reply.record)
        if not len(self):
            self.idle.set()

    def get(self, reply_id: str) -> Reply | None:
        return self.replies.get(reply_id)

    def shut_down(self) -> None:
        """Stop every producer with a shutdown error, and interrupt every blocked reader."""
        self.shutting_down = True
        for reply in list(self.replies.values()):
            reply.stop("shutdown")
        for channel in list(self.channels):
            channel.close(End("shutdown"))
        for hook in list(self.readers):
            hook()

    async def wait_stopped(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.idle.wait()

    async def aclose(self) -> None:
        """Stop everything still running and wait for the producers' cleanup."""
        self.shut_down()
        tasks = [r.task for r in self.replies.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
