"""One client reply over one or more upstream attempts: failover before the first token,
stall detection and, when the request allows it, continuation after it.

This file decides when an attempt has failed and what happens next:
- Before the first content (the commit point, as for hold-back: nothing but headers and
  keep-alives has reached the client): a connect error, a 5xx or 429, an error in the
  stream, or no content within ``ttft_s`` of the attempt's start (its response head's wait
  included) moves the request to the next upstream of the plan, invisibly to the client,
  until ``failover_s`` has passed since the request began. An upstream that refused the
  request itself (a 400) is not retried elsewhere; one that does not serve the model sent
  (a 404) is, and its circuit does not count it.
- After it: no content for ``stall_s`` is ``upstream_stalled``; that, or any failure of the
  stream, ends the reply with that error, or, with continuation on, sends the prompt plus
  the text already relayed (as the assistant's prefix, ``continue_final_message``) to the
  next upstream, and the reply goes on from there: an empty marker delta (``continued``)
  first, then the new upstream's text. Nothing relayed is sent twice.
- A stop string of the request that completes in the text relayed (across seams too) ends
  the reply as finished, as the built-in engines stop at one: the attempt ended well and its
  upstream connection is closed. The reply pipeline cuts and names it; the relay only stops
  an upstream that writes on (one sent no stop strings: ``upstream_request.stops_sent``).
- An upstream that writes past the request's ``max_tokens`` (it was sent that limit, and
  ignored it) is stopped there: what comes past the limit is dropped, its connection closed,
  and the reply ends with the relay's own ``length``. Text an upstream sent stop strings
  withheld, as it could begin one, and releases after its last token (replystream's own
  servers send it in a chunk of its own) is no such content: text past the limit that is
  the start of one of them passes.
Which upstream the next attempt goes to, the wait for room at upstreams at their limit, what
the reply ends with when none is left, and what each attempt's end counts and logs are
``upstream_attempts``'s (a ``RelayedReply`` is an ``AttemptSeries``). It must not know how an
attempt is sent (``Opener``) or anything about our HTTP server. Its terms (limits, counts,
errors, what a failure is counted as) are ``upstream_relay_types``'s.

A reply is read one of two ways, with the same decisions: iterated (each read awaits the
current attempt), or attached to a sink (``PushDeltaStream``): then the reply is itself the
sink of its current attempt's stream, each delta goes on to the client's sink in the same
call, an attempt's failure arrives in ``on_end`` (or from the watchdog's timer) and is
decided at once; only opening the next attempt, which awaits a response head, runs as a task
(``_reopen``), and only then. No task and no wake-up per chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

from replystream.engine.base import Delta, DeltaSink, EngineError, GenerationRequest
from replystream.engine.stops import StopScan
from replystream.engine.upstream_admission import ChoiceRoom
from replystream.engine.upstream_attempts import AttemptSeries
from replystream.engine.upstream_pool import UpstreamPool
from replystream.engine.upstream_queue import RoomQueue
from replystream.engine.upstream_relay_types import (
    IN_STREAM,
    Opener,
    RelayBroken,
    RelayCounts,
    RelayLimits,
)
from replystream.engine.upstream_request import stops_sent
from replystream.engine.upstream_slots import SharedLimits
from replystream.stalls import LOOK_AGAIN_S, fired_late

log = logging.getLogger("replystream.upstream")


def _completes_stop(scan: StopScan, delta: Delta) -> bool:
    """Whether ``delta`` completes one of the request's stop strings in the text relayed so
    far (across seams: one attempt's text goes on in the next), as the reply pipeline reads
    it: a tool call or a thought between two texts breaks it."""
    if delta.text:
        return scan.feed(delta.text) is not None
    if delta.tool_call is not None or delta.reasoning:
        scan.break_text()
    return False


class _Cut(NamedTuple):
    """Where the relay ends a reply: how many of the deltas at hand still go out, and the
    finish reason it gives."""

    relayed: int
    reason: str


class RelayedReply(AttemptSeries):
    """A ``PushDeltaStream`` over a sequence of upstream attempts."""

    # Thousands are open at once: slots instead of an instance dict (``AttemptSeries``
    # holds the attempts' own).
    __slots__ = (
        "_check_at",
        "_continuation",
        "_continued",
        "_done",
        "_held",
        "_limit",
        "_looked_again",
        "_loop",
        "_opening",
        "_overdue",
        "_seam",
        "_sink",
        "_stops",
        "_stops_sent",
        "_tail",
        "_text_at",
        "_waiter",
    )

    def __init__(
        self,
        request: GenerationRequest,
        *,
        pool: UpstreamPool,
        opener: Opener,
        limits: RelayLimits,
        continuation: bool,
        counts: RelayCounts,
        queue: RoomQueue,
        affinity: str | None = None,
        shared: SharedLimits | None = None,
        choices: ChoiceRoom | None = None,
    ) -> None:
        super().__init__(
            request,
            pool=pool,
            opener=opener,
            limits=limits,
            counts=counts,
            queue=queue,
            affinity=affinity,
            shared=shared,
            choices=choices,
        )
        self._continuation = continuation
        self._seam: str | None = None  # why the next attempt continues the reply
        self._continued = False  # it went on at another upstream (counted once)
        # Deltas to yield before reading on (iterated): the first text after a seam, behind
        # its marker; a finish the relay made.
        self._held: tuple[Delta, ...] = ()
        # The text relayed, watched for the request's stop strings (None: it has none).
        stops = request.sampling.stop
        self._stops = StopScan(stops) if stops else None
        # The text an upstream may still send after the request's last token: what it held
        # back as the start of a stop string it was sent (none when the client is told which
        # one ended the reply). ``_tail``: that text so far.
        self._stops_sent = stops_sent(request)
        self._tail = ""
        # The watchdog (``_watch``): when the last text came, how long the next may take.
        self._loop = asyncio.get_running_loop()  # made by the engine's ``start``
        self._text_at = 0.0
        self._check_at = 0.0  # when the watchdog's timer is due (``_arm``)
        self._looked_again = False  # its timer was put off for this process's own stall
        self._limit = limits.ttft_s
        self._waiter: asyncio.Task[object] | None = None
        self._overdue = False
        self._done = False
        # Attached: the client's sink, and the task opening the next attempt (only then).
        self._sink: DeltaSink | None = None
        self._opening: asyncio.Task[None] | None = None

    def __aiter__(self) -> RelayedReply:
        return self

    async def open(self) -> None:
        """The first attempt that gets a response head.

        Raises:
            RequestRejected: the upstream refused the request itself.
            EngineError: no upstream answered within the failover bound (the last failure).
        """
        await self._next_attempt()
        self._watch()

    # -- Iterated -------------------------------------------------------------------------

    async def __anext__(self) -> Delta:
        while True:
            if self._held:
                held, self._held = self._held[0], self._held[1:]
                return held
            if self._done:
                raise StopAsyncIteration
            if self._stream is None:
                await self._next_attempt()
                self._watch()
            stream = self._stream
            assert stream is not None
            flowing = self._flowing  # this attempt has sent content already
            task = self._waiter = asyncio.current_task()
            try:
                delta = await anext(stream)
            except StopAsyncIteration:
                self._done = True
                self._unwatch()
                self._attempt_over("ok")
                raise
            except asyncio.CancelledError:
                # The watchdog's cancel becomes a timeout; anyone else's stays a cancel.
                if not self._overdue or task is None or task.uncancel() > 0:
                    raise
                error = self._timed_out(self._limit, flowing)
            except EngineError as exc:
                error = exc
            else:
                self._text_at = time.monotonic()
                cut = self._took((delta,))
                if cut is not None and cut.relayed == 0:  # past the limit: the finish instead
                    self._finish(cut.reason)
                    continue
                if self._seam is not None:
                    # The client learns where the text comes from a new upstream, then reads it.
                    self._held = (delta,)
                    delta = self._marker(delta)
                if cut is not None:
                    self._finish(cut.reason)
                return delta
            finally:
                self._waiter, self._overdue = None, False
            if not self._attempt_broke(error):
                raise error

    # -- Attached -------------------------------------------------------------------------

    def attach(self, sink: DeltaSink) -> None:
        """Deliver every delta to ``sink`` as the current attempt's connection reads it. A
        reply not opened yet (a background request's: ``start`` did not wait) opens its
        first attempt now, in a task, as it would open the next one; its failure to is the
        reply's end."""
        self._sink = sink
        if self._stream is not None:
            self._stream.attach(self)
        elif self._opening is None and not self._done:
            self._opening = self._loop.create_task(self._reopen())

    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        """The current attempt's deltas (it is attached to this reply): on to the sink."""
        sink = self._sink
        if sink is None:
            return
        self._text_at = time.monotonic()  # not loop.time(): asyncio's is a Python call
        cut = self._took(deltas)
        if cut is not None:
            deltas = list(deltas)[: cut.relayed]  # (a deque, from the stream)
            if not deltas:  # all of them past the limit
                self._finish(cut.reason)
                return
        if self._seam is not None:
            deltas = [self._marker(deltas[0]), *deltas]
        try:
            sink.on_deltas(deltas)
        except Exception:  # a bug of ours downstream: this reply ends, its upstream closed
            log.exception("delivering a relayed reply's deltas failed")
            self.close()
            sink.on_end(RelayBroken("relaying the reply failed", code="upstream_broken"))
            return
        if cut is not None and self._sink is not None:
            # (At a stop string most often the reply pipeline, which cut it, closed this.)
            self._finish(cut.reason)

    def on_end(self, error: EngineError | None) -> None:
        """The current attempt ended: the reply with it, or the next attempt takes over."""
        self._stream = None  # it has closed itself
        if error is None:
            self._done = True
            self._unwatch()
            self._attempt_over("ok")
            self._ended(None)
        elif not self._attempt_broke(error):
            self._ended(error)

    def close(self) -> None:
        """Stop relaying now: close the current attempt's upstream connection (or stop
        opening one); the sink is called no more. Safe from inside the sink's own calls."""
        self._done = True
        self._held = ()
        self._sink = None
        opening, self._opening = self._opening, None
        if opening is not None:
            opening.cancel()
        self._close_stream()
        self._attempt_over("cancelled")

    async def aclose(self) -> None:
        """Stop relaying: close the current attempt's upstream connection."""
        self.close()

    def _ended(self, error: EngineError | None) -> None:
        self._done = True
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.on_end(error)

    async def _reopen(self) -> None:
        """Attached, after an attempt failed (or before the first, not opened by ``start``):
        open the next one and attach to it, or end the reply with the last failure."""
        try:
            await self._next_attempt()
            self._watch()
        except EngineError as error:
            self._opening = None
            if self._request.background and not self._relayed_any:  # (``start`` did not wait)
                self._counts.unopened += 1
            self._ended(error)
            return
        except Exception:
            self._opening = None
            log.exception("opening the next upstream attempt failed")
            self._ended(RelayBroken("relaying the reply failed", code="upstream_broken"))
            return
        self._opening = None
        if self._sink is not None and self._stream is not None:
            self._stream.attach(self)

    # -- Both -----------------------------------------------------------------------------

    def _took(self, deltas: Sequence[Delta]) -> _Cut | None:
        """What relaying ``deltas`` changes: the first content of an attempt (text, relayed
        thinking or a call) commits it, a tool call rules continuation out, a finish reason
        ends the attempt well, and so do a stop string completing in the text and content
        past the request's ``max_tokens`` (its upstream stopped: ``_end_whole``). Where the
        reply ends, when the relay ends it (None: it goes on)."""
        first = not self._flowing
        if first:
            self._flowing = True
            backend = self._backend
            assert backend is not None
            # From now on: the stall limit (its upstream's own, if it has one), from here.
            self._limit = self._limits.stall_s if backend.stall_s is None else backend.stall_s
            self._unwatch()
            backend.answered()
            backend.sent_first_text(deltas[0].made_at - self._attempt_began)
        self._relayed_any = True
        stops = self._stops
        most = self._request.sampling.max_tokens
        for index, delta in enumerate(deltas):
            if most is not None and self._tokens >= most and delta.finish_reason is None:
                if not self._withheld_tail(delta):
                    self._end_whole()  # content past the limit the upstream was sent
                    return _Cut(index, "length")
            if delta.tool_call is not None:
                # A continuation sends the text so far as the assistant's prefix; a call
                # cannot be sent that way, so a reply that made one ends with its error.
                self._continuation = False
            if self._continuation:  # kept only for a continuation's prefix
                self._sent.append(delta.text)
            self._tokens += delta.tokens
            if delta.finish_reason is not None:
                self._done = True
                self._unwatch()
                self._attempt_over("ok")
            elif stops is not None and _completes_stop(stops, delta):
                self._end_whole()
                return _Cut(index + 1, "stop")
        if first and not self._done:  # (an attempt this batch ended has no stall to watch for)
            self._arm(self._limit)
        return None

    def _withheld_tail(self, delta: Delta) -> bool:
        """Whether ``delta``, come after the request's last token, is text its upstream held
        back as it could begin a stop string it was sent: with the text before it past the
        limit, the start of one of them, shorter than it."""
        if delta.tool_call is not None or delta.reasoning or not delta.text:
            return False
        tail = self._tail + delta.text
        if not any(len(tail) < len(s) and s.startswith(tail) for s in self._stops_sent):
            return False
        self._tail = tail
        return True

    def _end_whole(self) -> None:
        """The reply is whole here, so the attempt ended well: a stop string completed (the
        reply pipeline ends the reply there), or the request's token limit was reached. Its
        upstream, sent no stop strings when the client is told which one ended the reply
        (``upstream_request.stops_sent``), or one that ignored them or the limit, would write
        on: its connection is closed, as at any cancel."""
        self._done = True
        self._unwatch()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.end_whole()
        self._attempt_over("ok")

    def _marker(self, first: Delta) -> Delta:
        """The empty delta that says the text goes on from a new upstream (``continued``)."""
        reason, self._seam = self._seam, None
        return Delta("", 0, first.made_at, continued=reason)

    def _attempt_broke(self, error: EngineError) -> bool:
        """The current attempt failed with ``error``: count it, close it, and decide. True
        if another attempt takes over (iterated: the next read opens it; attached: a task
        opens it now); False if the reply ends with ``error``."""
        flowing = self._flowing
        self._attempt_failed(error, IN_STREAM.get(error.code, "stream_error"))
        if flowing:
            if not self._continuation:
                return False
            if self._budget_spent():
                self._finish("length")
                return True
            self._seam = error.code  # the next attempt continues the text relayed so far
            if not self._continued:  # once per reply, however many seams it has
                self._continued = True
                self._counts.continuations += 1
            self._began = time.monotonic()
        if self._sink is not None:
            self._opening = self._loop.create_task(self._reopen())
        return True

    def _budget_spent(self) -> bool:
        """Whether the tokens relayed are all the request allows (``max_tokens``)."""
        most = self._request.sampling.max_tokens
        return most is not None and self._tokens >= most

    def _finish(self, reason: str) -> None:
        """End the reply with a finish of the relay's own: ``length`` when its upstream
        failed after the last token the request allows (a continuation could only send
        more), ``stop`` at a stop string its upstream did not stop at."""
        self._done = True
        finish = Delta("", 0, time.monotonic(), reason)
        sink = self._sink
        if sink is None:  # iterated: the next read yields it, then the end
            self._held += (finish,)
            return
        try:
            sink.on_deltas((finish,))
        except Exception:  # a bug of ours downstream, as in ``on_deltas``
            log.exception("delivering a relayed reply's deltas failed")
            self._ended(RelayBroken("relaying the reply failed", code="upstream_broken"))
            return
        self._ended(None)

    def _watch(self) -> None:
        """Once per attempt, from its head: the watchdog that notices no text for ``_limit``
        seconds (the first text's counted from the attempt's start, the head's wait in it).

        One timer per attempt rather than a timeout per delta (``asyncio.timeout`` costs
        several microseconds per chunk): each delta only stamps ``_text_at``, and the timer,
        when it fires early, sets itself again for the new due time."""
        self._loop = asyncio.get_running_loop()
        self._text_at = self._attempt_began
        self._limit = self._ttft_limit()
        due_in = self._text_at + self._limit - time.monotonic()
        self._arm(max(due_in, 0.0))

    def _arm(self, delay: float) -> None:
        """The watchdog looks in ``delay`` seconds."""
        self._check_at = time.monotonic() + delay
        self._timer = self._loop.call_later(delay, self._check)

    def _check(self) -> None:
        self._timer = None
        now = time.monotonic()
        if fired_late(self._check_at, now) and not self._looked_again:
            # This process was stalled (stopped, frozen, starved), not the upstream, whose
            # text may wait in the socket unread: looked at again once the loop has read it
            # (once: a loop always behind must still judge a stall).
            self._arm(LOOK_AGAIN_S)
            self._looked_again = True
            return
        self._looked_again = False
        stream = self._stream  # its upstream's thinking counts as progress, as text does
        progress = self._text_at if stream is None else max(self._text_at, stream.thought_at)
        due = progress + self._limit
        if now < due or (self._waiter is None and self._sink is None):
            # Text came since, or nobody reads yet: look again later.
            self._arm(max(due - now, min(self._limit, 0.1)))
            return
        if stream is not None and stream.finish_seen:
            # Only the usage and [DONE] were still to come: the reply is whole, not stalled.
            stream.end_at_finish()
            return
        if self._sink is not None:  # attached: the attempt failed, decided here and now
            error = self._timed_out(self._limit, self._flowing)
            if not self._attempt_broke(error):
                self._ended(error)
            return
        assert self._waiter is not None
        self._overdue = True
        self._waiter.cancel()
