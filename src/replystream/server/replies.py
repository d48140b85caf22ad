"""Replies in flight: each one's production, its readers, and how it stops.

A reply is produced under the ``ReplyManager``, not by the connection that asked for it: its
deltas go through the ``ReplyPipeline`` into the reply log, where any reader (the first
connection, or a resume on any replica) follows it. An engine that pushes calls the reply
with its deltas (no task per reply); any other is pulled by a producer task.
Disconnect policies: ``cancel`` stops generation when the last local reader leaves (the
default for replies nobody can resume); ``detach`` keeps generating for a grace period so a
client can come back, and stops if none has by then (the default for resumable replies);
``keep`` generates to the end whoever reads (a background response).
A reply's life is a phase table (``server.reply_phases``): every change of phase goes
through ``Reply._advance``. Every reply ends in ``Reply._conclude``, whatever stopped it:
the engine's stream closed, the last events and the terminal entry written as the ending's
row of ``server.reply_endings.ENDINGS`` says, the outcome counted, everything it held freed.
This file must not know about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

from replystream.delivery.channel import DeltaChannel, End
from replystream.delivery.follower import Follower, Sink, Watcher
from replystream.delivery.pipeline import Pipeline
from replystream.delivery.replay import (
    LogEntry,
    ReplayStore,
    StoreUnavailable,
)
from replystream.engine.base import (
    Delta,
    DeltaStream,
    EngineError,
    PushDeltaStream,
    QueuedDeltaStream,
)
from replystream.server.metrics import Metrics, Outcome, ReplyRecord
from replystream.server.reply_endings import Ending, StopReason
from replystream.server.reply_phases import Event, Phase, next_phase

log = logging.getLogger("replystream.replies")

Disconnect = Literal["cancel", "detach", "keep"]
# Overdue deltas are appended together, but in pieces of about this much text: a reader past
# its slow-client limit stops the reply after one piece, not after all of a late tick's tokens.
APPEND_CHUNK_BYTES = 16 * 1024
__all__ = ["Disconnect", "Reply", "ReplyManager", "StopReason", "close_quietly"]
# Read on every delta (and ``live`` on every reader's wake-up): module names, not
# attributes of the enum class.
_NEW, _PRODUCING, _ENDED = Phase.NEW, Phase.PRODUCING, Phase.ENDED
_FINISHED = Ending("finished")


async def close_quietly(deltas: DeltaStream) -> None:
    """Close an engine stream, bounded and shielded, from any exit path."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        async with asyncio.timeout(1.0):
            await asyncio.shield(deltas.aclose())


class ReplyConnection(Protocol):
    """A connection that carries replies of its own and outlives each of them (a
    WebSocket): told when the server shuts down, so it can say goodbye and close."""

    def server_stopping(self) -> None: ...


@dataclass(eq=False, slots=True)
class Reply:
    """One reply being generated in this process."""

    reply_id: str
    deltas: DeltaStream
    pipeline: Pipeline
    store: ReplayStore
    record: ReplyRecord
    prompt_tokens: int
    disconnect: Disconnect
    detach_grace_s: float
    manager: ReplyManager
    resumable: bool = False
    pushes: bool = False  # ``deltas`` is a PushDeltaStream (the engine said so)
    # ``deltas`` is a QueuedDeltaStream (the engine said so): its request may wait in the
    # engine's queue, and the reply logs the engine taking it up when it does.
    queues: bool = False
    readers: int = 0
    # Lists, not sets: a reply has one reader or a few, and thousands of replies each hold these.
    followers: list[Watcher] = field(default_factory=list)  # its readers in this process
    sinks: list[Sink] = field(default_factory=list)  # readers the producer writes to directly
    task: asyncio.Task[None] | None = None  # the producer task, for engines that do not push
    _phase: Phase = Phase.NEW  # changed only by ``_advance``
    _ending: Ending | None = None  # decided once, as production ends
    _window_timer: asyncio.TimerHandle | None = None
    _pushed: PushDeltaStream | None = None  # the stream, when the engine pushes its deltas
    _attaching: bool = False  # inside the pushed stream's ``attach`` (see ``_production_ended``)
    _conclusion: asyncio.Handle | None = None  # its conclusion, put off by ``_production_ended``
    # When the detach grace ends, or (``cancel``) when to look again for a reader elsewhere.
    _detach_timer: asyncio.TimerHandle | None = None
    # Called once as the reply ends: what it holds of its client's limits (a background
    # response is its client's open request until then).
    _ended_call: Callable[[], None] | None = None
    # Room among its client's limits for a detached reply, generating for nobody: takes it
    # (giving what frees it) or says None, none is left. None: the client has no limits.
    take_room: Callable[[], Callable[[], None] | None] | None = None
    _room: Callable[[], None] | None = None  # what frees the room held while detached

    def when_ended(self, call: Callable[[], None]) -> None:
        """Call ``call`` once the reply has ended (now, if it has)."""
        if self._phase is Phase.ENDED:
            call()
        else:
            self._ended_call = call

    @property
    def last_seq(self) -> int:
        """The number of the last event logged so far."""
        return self.pipeline.next_seq - 1

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def live(self) -> bool:
        """Begun and not yet ended."""
        phase = self._phase
        return phase is not _NEW and phase is not _ENDED

    def how_ended(self) -> tuple[Outcome, str | None] | None:
        """Its outcome and reason (None: none) as its record counts them, once its ending is
        decided (a finish whose end a check then matched is ``moderated`` once concluded);
        None while it goes on."""
        ending = self._ending
        if ending is None:
            return None
        rule = ending.rule
        return rule.outcome, ending.fill(rule.reason) or None

    def _advance(self, event: Event) -> bool:
        """Apply ``event`` as the phase table says (the one place the phase changes); False
        if the table ignores it in this phase. An illegal event raises ``IllegalTransition``."""
        found = next_phase(self._phase, event)
        if found is None:
            return False
        self._phase = found
        return True

    def _end(self, ending: Ending) -> bool:
        """Production ends for ``ending``, unless an ending was decided already (the first
        wins); a pushing engine is stopped at once. True if this one was decided."""
        if not self._advance(Event.ENDED):
            return False
        self._ending = ending
        if self._pushed is not None:
            self._pushed.close()  # no more deltas: what leaving ``produce`` does for a pull
        return True

    def stop(self, reason: StopReason) -> None:
        """Stop generating; the log ends with an event that says why."""
        had_run = self._phase is _PRODUCING
        if not self._end(Ending(reason)):
            return
        if self._pushed is not None:
            # A pushed reply ends in the next loop turn, as a cancelled task would: the
            # caller may be in the middle of this reply's own append.
            asyncio.get_running_loop().call_soon(self._conclude)
        # A task cancelled before it first runs never enters ``produce`` (nor its
        # ``finally``): one that has not run sees the phase when it does. The producer
        # stopping itself (a reader cut inside its own append) sees it after the append.
        elif had_run and self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def reader_joined(self) -> None:
        self.readers += 1
        if self._detach_timer is not None:
            self._detach_timer.cancel()
            self._detach_timer = None
            self._free_room()  # a reader's own request holds its room now

    def reader_left(self, reason: StopReason) -> None:
        self.readers -= 1
        if not self.live:
            self.forget_if_unwanted()
            return
        if self.readers or self.disconnect == "keep":
            return
        if self.disconnect == "cancel":
            self._stop_once_unread(self.store.readers_elsewhere_seen_within_s, reason)
        elif self._detach_timer is None:
            if self.take_room is not None:
                self._room = self.take_room()
                if self._room is None:
                    self.stop("detach_refused")
                    return
            grace_s, loop = self._grace_s(), asyncio.get_running_loop()
            self._detach_timer = loop.call_later(
                grace_s, self._stop_once_unread, grace_s, "detach_expired"
            )

    def consumed(self, upto: int) -> None:
        """A reader has sent everything up to ``upto``; a reply nobody may resume, with one
        reader, needs none of it again, so its log stops growing with the reply. A reply
        whose conclusion was put off (``_production_ended``) concludes now."""
        if not self.resumable and self.readers == 1:
            self.store.release(self.reply_id, upto)
        if self._conclusion is not None:
            # It ended inside ``attach``, and a reader has joined and sent its opening events:
            # concluded now, that reader finds the last events at its next look, in this turn,
            # rather than waiting for the turn it was put off to and then being woken.
            self._conclusion.cancel()
            self._conclude()

    def reader_fell_behind(self) -> None:
        """The only reader of a reply nobody may resume is past the slow-client limit: stop
        generating now (its task will cut the connection), so the log stops growing."""
        if self.disconnect == "cancel" and self.readers == 1:
            self.stop("slow_client")

    def forget_if_unwanted(self) -> None:
        """Drop the log of an ended reply nobody may resume, once its last reader is done."""
        if not self.resumable and self.readers == 0:
            self.store.discard(self.reply_id)

    def _free_room(self) -> None:
        if self._room is not None:
            room, self._room = self._room, None
            room()

    def _grace_s(self) -> float:
        """The detach grace, and the time a reader that joined on another replica within it
        may take to be known here: stopped sooner, the reply would be cut under that reader."""
        return self.detach_grace_s + self.store.readers_elsewhere_seen_within_s

    def _stop_once_unread(self, within_s: float, reason: StopReason) -> None:
        """Stop, the last reader here having left: unless a reader has come back, or one on
        another replica (a reader too) was found reading within ``within_s``, in which case
        look again once that finding is that old."""
        self._detach_timer = None
        if self.readers:
            return
        seen = self.store.read_elsewhere_at(self.reply_id)
        left = 0.0 if seen is None else seen + within_s - time.monotonic()
        if left > 0:
            loop = asyncio.get_running_loop()
            self._detach_timer = loop.call_later(left, self._stop_once_unread, within_s, reason)
            return
        self.stop(reason)

    def _append(self, entries: list[LogEntry], *, push: bool = True) -> None:
        if entries:
            self.store.append(self.reply_id, entries)
            # Neither a push nor an interrupt changes these lists (readers leave from their
            # own task).
            if push:
                for sink in self.sinks:
                    sink.push(entries)
            for follower in self.followers:
                follower.interrupt(entries)

    def _flush_window(self) -> None:
        self._window_timer = None
        self._append(self.pipeline.flush_due(time.monotonic()))
        if self._phase is _PRODUCING:  # another choice's batch may still be open, due later
            self._arm_window()

    def _arm_window(self) -> None:
        due = self.pipeline.batch_due_at
        if due is not None and self._window_timer is None:
            delay = max(0.0, due - time.monotonic())
            self._window_timer = asyncio.get_running_loop().call_later(delay, self._flush_window)

    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        """Deltas from the engine: through the pipeline into the log (sync, no waiting).
        Deltas that came due together are appended together, so a reader writes them at once.
        """
        if self._phase is not _PRODUCING:
            return
        record, pipeline = self.record, self.pipeline
        now = time.monotonic()
        entries: list[LogEntry] = []
        size = 0
        for delta in deltas:
            record.on_delta(delta.made_at, delta.tokens, delta.choice)
            entries += pipeline.push(delta, now)
            if pipeline.halted:  # a check failed or a stop string completed
                break
            size += len(delta.text)
            if size >= APPEND_CHUNK_BYTES:
                # A reader that cannot take this much stops the reply during the append; the
                # rest of the deltas are then never logged.
                self._append(entries)
                if self._phase is not _PRODUCING:
                    return
                entries, size = [], 0
        self._append(entries)
        if pipeline.halted:
            violation = pipeline.violation
            # At a stop string the reply finished: the engine is stopped like any other.
            self._production_ended(
                _FINISHED if violation is None else Ending("moderated", violation.check)
            )
            return
        failure = self.store.failure(self.reply_id)
        if failure is not None:
            # Said as every reader elsewhere says it, when the store fails under them.
            self._production_ended(Ending("store_failure", StoreUnavailable(failure).describe()))
            return
        if pipeline.batching:  # a time window to keep (most replies batch nothing)
            self._arm_window()

    def on_end(self, error: EngineError | None) -> None:
        """The engine's stream ended (pushed streams only)."""
        self._production_ended(_FINISHED if error is None else Ending.of_error(error))

    def begin(self) -> None:
        """Log the opening events and start production: the engine pushes deltas to this
        reply if it can (no task of its own), else a producer task pulls them."""
        if self.pushes:  # the engine says its streams are PushDeltaStreams
            self._pushed = cast(PushDeltaStream, self.deltas)
            self._advance(Event.ATTACHED)
        else:
            self._advance(Event.SPAWNED)
        # The opening events are logged at once, so the first reader finds them ready and
        # its response headers leave together with them; so is the request's admission, for
        # an engine with no queue of its own (else when it tells: ``_admitted``).
        opening = self.pipeline.start(self.reply_id)
        if not self.queues:
            opening += self.pipeline.admitted()
        self._append(opening)
        if self.queues:
            self.record.admitted_at = None  # (not when ``start`` returned: when it is told)
            cast(QueuedDeltaStream, self.deltas).when_admitted(self._admitted)
        if self._pushed is not None:
            self._attaching = True
            try:
                self._pushed.attach(self)
            finally:
                self._attaching = False
        else:
            self.task = asyncio.get_running_loop().create_task(
                self.produce(), name=f"reply-{self.reply_id[:8]}"
            )

    def _admitted(self) -> None:
        """The engine has taken the request up (before its first delta): logged, unless the
        reply's ending is decided already (it was stopped while it waited)."""
        if self._phase is _PRODUCING or self._phase is Phase.STARTING:
            self.record.admitted()
            self._append(self.pipeline.admitted())

    def _production_ended(self, ending: Ending) -> None:
        """The stream, a check or the store ended production: a pushed reply ends now (in
        the next turn of the loop if it ended inside ``attach``); a pulled one's task ends it
        once its loop sees the phase."""
        if self._end(ending) and self._pushed is not None:
            if self._attaching:
                # Ended inside ``attach`` (nothing was left to make, or the first text ended
                # it): the first reader joins once ``begin`` has returned, in this turn of the
                # loop. Concluded now, a reply nobody may resume would forget its log first;
                # concluded in the next turn, as a producer task would, the reader has it
                # (or sooner, once a reader has sent what it found: ``consumed``).
                self._conclusion = asyncio.get_running_loop().call_soon(self._conclude)
            else:
                self._conclude()

    async def produce(self) -> None:
        """Pull the engine's deltas into the log until the stream ends or the reply stops."""
        try:
            self._advance(Event.TASK_RUNS)
            if self._phase is _PRODUCING:  # not stopped before it ran
                async for delta in self.deltas:
                    self.on_deltas((delta,))
                    if self._phase is not _PRODUCING:
                        break
            self._end(_FINISHED)  # ignored if something else ended it first
        except asyncio.CancelledError:
            # This task is only ever cancelled through ``stop``, which decided the ending.
            self._end(Ending("cancelled"))
        except Exception as exc:  # an EngineError, or a failure of our own
            if not self._end(Ending.of_error(exc)):
                log.error(
                    "reply %s: producer failed after it had stopped", self.reply_id, exc_info=exc
                )
        finally:
            await close_quietly(self.deltas)
            self._conclude()

    def _conclude(self) -> None:
        """End the reply as its ending's row of ``ENDINGS`` says: its last events, its
        outcome, and everything it held. Runs once, however the reply ended."""
        self._advance(Event.CONCLUDED)
        self._conclusion = None
        ending, record = self._ending, self.record
        assert ending is not None  # decided on the way into STOPPING
        rule = ending.rule
        if rule.log_level is not None:  # named: at WARNING no access-log line names it
            said = ending.fill(rule.log_message)
            log.log(rule.log_level, "reply %s: %s", self.reply_id, said, exc_info=ending.error)
        last: list[LogEntry] = []
        reported = self.pipeline.prompt_tokens
        record.prompt_tokens = self.prompt_tokens if reported is None else reported
        record.cached_prompt_tokens = self.pipeline.cached_prompt_tokens or 0
        if rule.in_band == "end marker":
            last = self.pipeline.finish()
            violation = self.pipeline.violation
            if violation is not None:
                # A match the text's end decided (one that reached the end of the text so
                # far): ``finish`` logged the ``moderated`` event, and the reply ends so.
                ending = self._ending = Ending("moderated", violation.check)
                rule = ending.rule
        elif rule.in_band == "error":
            message, code = ending.fill(rule.message), ending.fill(rule.code)
            last = self.pipeline.fail(message, code, ending.status)
        # (``moderated``: its event was logged as the check matched.)
        if rule.reason:
            record.reason = ending.fill(rule.reason)
        # Not pushed: the readers, woken below, send the last events with the end of the body.
        self._append(last, push=False)
        for timer in (self._window_timer, self._detach_timer):
            if timer is not None:
                timer.cancel()
        self._free_room()
        record.outcome = rule.outcome
        self.store.end(self.reply_id, rule.log_end)
        for sink in list(self.sinks):
            sink.wake()
        for follower in list(self.followers):
            follower.interrupt()
        self.manager.finished(self)
        if self._ended_call is not None:
            call, self._ended_call = self._ended_call, None
            call()
        self.forget_if_unwanted()


class ReplyManager:
    """Owns every producer task of this process; stops them on shutdown."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.replies: dict[str, Reply] = {}
        self.channels: set[DeltaChannel] = set()  # buffered replies being collected
        # Whole answers made outside a reply (an embeddings request's upstream call): the
        # grace period waits for them, and shutdown cancels those still running then.
        self.answers: set[asyncio.Future[Any]] = set()
        self.readers: set[Follower] = set()  # every open reader, to interrupt on shutdown
        self.unread = asyncio.Event()  # set while no reader is open
        self.unread.set()
        self.connections: set[ReplyConnection] = set()  # to close on shutdown
        self.quiet = asyncio.Event()  # set once shut down, with no reader or connection left
        self.idle = asyncio.Event()
        self.idle.set()
        self.accepting = True  # False from the moment shutdown begins: no new replies
        self.shutting_down = False  # True once the grace period is over
        # Read when scraped: a gauge moved on every start and end costs a lock each time.
        metrics.read_on_scrape(metrics.active, lambda: len(self.replies))

    def __len__(self) -> int:
        return len(self.replies) + len(self.channels) + len(self.answers)

    def hold(self, answer: asyncio.Future[Any]) -> None:
        """``answer`` is in flight until done: shutdown waits for it, then cancels it."""
        self.answers.add(answer)
        self.idle.clear()
        answer.add_done_callback(self._let_go)

    def _let_go(self, answer: asyncio.Future[Any]) -> None:
        self.answers.discard(answer)
        if not len(self):
            self.idle.set()

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
        reply.begin()

    def finished(self, reply: Reply) -> None:
        self.replies.pop(reply.reply_id, None)
        self.metrics.observe(reply.record)
        if not len(self):
            self.idle.set()

    def get(self, reply_id: str) -> Reply | None:
        return self.replies.get(reply_id)

    def stop_accepting(self) -> None:
        """Shutdown has begun: replies in flight may finish, new ones are refused."""
        self.accepting = False

    def shut_down(self) -> None:
        """Stop every producer with a shutdown error, interrupt every blocked reader, and
        tell every connection carrying replies to close once it has sent their endings."""
        self.accepting = False
        self.shutting_down = True
        for reply in list(self.replies.values()):
            reply.stop("shutdown")
        for channel in list(self.channels):
            channel.close(End("shutdown"))
        for answer in list(self.answers):
            answer.cancel()
        for reader in list(self.readers):
            reader.interrupt()
        for connection in list(self.connections):
            connection.server_stopping()
        self._note_if_quiet()

    def add_reader(self, reader: Follower) -> None:
        self.readers.add(reader)
        self.unread.clear()

    def forget_reader(self, reader: Follower) -> None:
        self.readers.discard(reader)
        if not self.readers:
            self.unread.set()
        self._note_if_quiet()

    def forget_connection(self, connection: ReplyConnection) -> None:
        self.connections.discard(connection)
        self._note_if_quiet()

    def _note_if_quiet(self) -> None:
        if self.shutting_down and not self.readers and not self.connections:
            self.quiet.set()

    async def wait_quiet(self, timeout_s: float) -> None:
        """After ``shut_down``: wait for every reader and connection to be done."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.quiet.wait()

    async def wait_drained(self) -> None:
        """The grace (its caller bounds it): wait for every reply, whole answer and reader to
        be done. A reply that ended may still be on its way to a slow client, and a reader
        may follow a reply another replica makes: both are streams in flight."""
        while len(self) or self.readers:
            await self.idle.wait()
            await self.unread.wait()

    async def wait_stopped(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.idle.wait()

    async def aclose(self) -> None:
        """Stop everything still running and wait for the producers' cleanup."""
        self.shut_down()
        await self.wait_stopped(5.0)
