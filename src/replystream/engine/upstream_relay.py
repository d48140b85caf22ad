"""One client reply over one or more upstream attempts: failover before the first token,
stall detection and, when the request allows it, continuation after it.

This file decides when an attempt has failed and what happens next:
- Before the first content (the commit point, as for hold-back: nothing but headers and
  keep-alives has reached the client): a connect error, a 5xx or 429, an error in the
  stream, or no content within ``ttft_s`` moves the request to the next upstream of the
  plan, invisibly to the client, until ``failover_s`` has passed since the request began.
  An upstream that refused the request itself (a 400) is not retried elsewhere; one that
  does not serve the model sent (a 404) is, and its circuit does not count it. A busy
  upstream's ``Retry-After`` keeps its circuit open at least that long (``upstream_pool``);
  when no upstream is left, a 503 says when one may take a request (``retry_after_s``).
- After it: no content for ``stall_s`` is ``upstream_stalled``; that, or any failure of the
  stream, ends the reply with that error, or, with continuation on, sends the prompt plus
  the text already relayed (as the assistant's prefix, ``continue_final_message``) to the
  next upstream, and the reply goes on from there: an empty marker delta (``continued``)
  first, then the new upstream's text. Nothing relayed is sent twice.
When every upstream left for a request is at its limit of requests at once, it waits for
room (``upstream_queue``) for at most ``queue_s``, then is ``upstream_busy`` (503). With
``shared`` limits (the workers of one server), an attempt at an upstream with a limit also
holds one of its slots (``upstream_slots``) from the moment it is chosen to its end, however
it ends; an upstream whose slots the other workers hold is passed over as one at its limit.
Every attempt's result is counted on its backend and logged (``replystream.access``, one JSON
line each, with the request id). It must not know how an attempt is sent (``Opener``) or
anything about our HTTP server. Its terms (limits, counts, errors, what a failure is counted
as) are ``upstream_relay_types``'s; what a continuation sends, ``upstream_continuation``'s.

A reply is read one of two ways, with the same decisions: iterated (each read awaits the
current attempt), or attached to a sink (``PushDeltaStream``): then the reply is itself the
sink of its current attempt's stream, each delta goes on to the client's sink in the same
call, an attempt's failure arrives in ``on_end`` (or from the watchdog's timer) and is
decided at once; only opening the next attempt, which awaits a response head, runs as a task
(``_reopen``), and only then. No task and no wake-up per chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence

from replystream.engine.base import (
    Delta,
    DeltaSink,
    EngineError,
    GenerationRequest,
    RequestRejected,
)
from replystream.engine.upstream_affinity import home, preferred
from replystream.engine.upstream_continuation import continued_request
from replystream.engine.upstream_pool import Backend, UpstreamPool
from replystream.engine.upstream_queue import RoomQueue
from replystream.engine.upstream_relay_types import (
    AT_HEAD,
    IN_STREAM,
    NOT_ITS_HEALTH,
    Attempt,
    NoUpstream,
    Opener,
    RelayBroken,
    RelayCounts,
    RelayLimits,
    RelayStalled,
    UpstreamBusy,
)
from replystream.engine.upstream_shared_limits import Slot, take_slot
from replystream.engine.upstream_slots import SharedLimits

access_log = logging.getLogger("replystream.access")
log = logging.getLogger("replystream.upstream")


class RelayedReply:
    """A ``PushDeltaStream`` over a sequence of upstream attempts."""

    # Thousands are open at once: slots instead of an instance dict.
    __slots__ = (
        "_affinity",
        "_attempt_began",
        "_backend",
        "_began",
        "_continuation",
        "_continued",
        "_counts",
        "_done",
        "_flowing",
        "_held",
        "_last_error",
        "_limit",
        "_limits",
        "_loop",
        "_model",
        "_opener",
        "_opening",
        "_overdue",
        "_pool",
        "_queue",
        "_relayed_any",
        "_request",
        "_seam",
        "_sent",
        "_shared",
        "_sink",
        "_slot",
        "_stream",
        "_text_at",
        "_timer",
        "_tokens",
        "_trial",
        "_tried",
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
    ) -> None:
        self._request = request
        self._pool = pool
        self._queue = queue
        # With workers: the limits all of them hold together, and the slot this attempt holds.
        self._shared = shared
        self._slot: Slot | None = None
        # Routed by prefix: the upstream its key prefers goes first (else the least loaded).
        self._affinity = affinity
        self._opener = opener
        self._limits = limits
        self._continuation = continuation
        self._counts = counts
        self._model = pool.resolve(request.model)
        self._tried: set[Backend] = set()
        self._began = time.monotonic()  # of the request, or of the latest seam
        self._backend: Backend | None = None
        self._trial = False  # the current attempt is its upstream's circuit's trial
        self._stream: Attempt | None = None
        self._attempt_began = 0.0
        self._flowing = False  # the current attempt has relayed content
        self._sent: list[str] = []  # every text relayed, in order (with continuation on)
        self._relayed_any = False
        self._tokens = 0
        self._seam: str | None = None  # why the next attempt continues the reply
        self._continued = False  # it went on at another upstream (counted once)
        self._held: Delta | None = None
        # The watchdog (``_watch``): when the last text came, how long the next may take.
        self._loop = asyncio.get_running_loop()  # made by the engine's ``start``
        self._text_at = 0.0
        self._limit = limits.ttft_s
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task[object] | None = None
        self._overdue = False
        self._done = False
        self._last_error: EngineError | None = None
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

    # -- Iterated -------------------------------------------------------------------------

    async def __anext__(self) -> Delta:
        while True:
            if self._held is not None:  # the first text after a seam, behind its marker
                held, self._held = self._held, None
                return held
            if self._done:
                raise StopAsyncIteration
            if self._stream is None:
                await self._next_attempt()
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
                self._took((delta,))
                if self._seam is None:
                    return delta
                # The client learns where the text comes from a new upstream, then reads it.
                self._held = delta
                return self._marker(delta)
            finally:
                self._waiter, self._overdue = None, False
            if not self._attempt_broke(error):
                raise error

    # -- Attached -------------------------------------------------------------------------

    def attach(self, sink: DeltaSink) -> None:
        """Deliver every delta to ``sink`` as the current attempt's connection reads it."""
        self._sink = sink
        if self._stream is not None:
            self._stream.attach(self)

    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        """The current attempt's deltas (it is attached to this reply): on to the sink."""
        sink = self._sink
        if sink is None:
            return
        self._text_at = time.monotonic()  # not loop.time(): asyncio's is a Python call
        self._took(deltas)
        if self._seam is not None:
            deltas = [self._marker(deltas[0]), *deltas]
        try:
            sink.on_deltas(deltas)
        except Exception:  # a bug of ours downstream: this reply ends, its upstream closed
            log.exception("delivering a relayed reply's deltas failed")
            self.close()
            sink.on_end(RelayBroken("relaying the reply failed", code="upstream_broken"))

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
        self._held = None
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
        """Attached, after an attempt failed: open the next one and attach to it, or end
        the reply with the last failure."""
        try:
            await self._next_attempt()
        except EngineError as error:
            self._opening = None
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

    def _took(self, deltas: Sequence[Delta]) -> None:
        """What relaying ``deltas`` changes: the first content of an attempt (text, relayed
        thinking or a call) commits it, a tool call rules continuation out, a finish reason
        ends the attempt well."""
        if not self._flowing:
            self._flowing = True
            backend = self._backend
            assert backend is not None
            # From now on: the stall limit (its upstream's own, if it has one), from here.
            self._limit = self._limits.stall_s if backend.stall_s is None else backend.stall_s
            self._unwatch()
            self._timer = self._loop.call_later(self._limit, self._check)
            backend.answered()
            backend.sent_first_text(deltas[0].made_at - self._attempt_began)
        self._relayed_any = True
        for delta in deltas:
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
                self._finish_at_length()
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

    def _finish_at_length(self) -> None:
        """End the reply as one that reached its token budget: its upstream failed after
        the last token the request allows, and a continuation could only send more."""
        self._done = True
        finish = Delta("", 0, time.monotonic(), "length")
        sink = self._sink
        if sink is None:  # iterated: the next read yields it, then the end
            self._held = finish
            return
        try:
            sink.on_deltas((finish,))
        except Exception:  # a bug of ours downstream, as in ``on_deltas``
            log.exception("delivering a relayed reply's deltas failed")
            self._ended(RelayBroken("relaying the reply failed", code="upstream_broken"))
            return
        self._ended(None)

    def _watch(self) -> None:
        """Once per attempt: the watchdog that notices no text for ``_limit`` seconds.

        One timer per attempt rather than a timeout per delta (``asyncio.timeout`` costs
        several microseconds per chunk): each delta only stamps ``_text_at``, and the timer,
        when it fires early, sets itself again for the new due time."""
        self._loop = asyncio.get_running_loop()
        self._text_at = time.monotonic()
        self._limit = self._ttft_limit()
        self._timer = self._loop.call_later(self._limit, self._check)

    def _check(self) -> None:
        self._timer = None
        stream = self._stream  # its upstream's thinking counts as progress, as text does
        progress = self._text_at if stream is None else max(self._text_at, stream.thought_at)
        due = progress + self._limit
        now = time.monotonic()
        if now < due or (self._waiter is None and self._sink is None):
            # Text came since, or nobody reads yet: look again later.
            delay = max(due - now, min(self._limit, 0.1))
            self._timer = self._loop.call_later(delay, self._check)
            return
        if self._sink is not None:  # attached: the attempt failed, decided here and now
            error = self._timed_out(self._limit, self._flowing)
            if not self._attempt_broke(error):
                self._ended(error)
            return
        assert self._waiter is not None
        self._overdue = True
        self._waiter.cancel()

    def _unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _own_ttft_s(self) -> float:
        """The current attempt's upstream's time to its first content, else the relay's."""
        backend = self._backend
        return self._limits.ttft_s if backend is None or backend.ttft_s is None else backend.ttft_s

    def _ttft_limit(self) -> float:
        """The current attempt's time to its first content: its upstream's own limit, if it
        has one, else the relay's; no later than the failover window's end."""
        left = self._limits.failover_s - (time.monotonic() - self._began)
        return max(0.001, min(self._own_ttft_s(), left))

    def _timed_out(self, limit: float, flowing: bool) -> EngineError:
        where = "the upstream" if self._backend is None else f"the upstream at {self._backend.name}"
        if flowing:
            return RelayStalled(
                f"{where} sent no text for {limit:g} s mid-reply", code="upstream_stalled"
            )
        if limit < self._own_ttft_s():  # what the window had left, not a limit of its own
            return RelayStalled(
                f"{where} sent no text before the failover window "
                f"({self._limits.failover_s:g} s) ended",
                code="upstream_ttft_timeout",
            )
        return RelayStalled(
            f"{where} sent no text within {limit:g} s", code="upstream_ttft_timeout"
        )

    async def _next_attempt(self) -> None:
        """Open the next upstream of the plan that answers, waiting for room when those left
        are at their limit of requests at once; raise when none is left."""
        queued_at: float | None = None
        while True:
            if self._tried and time.monotonic() - self._began >= self._limits.failover_s:
                raise self._give_up()
            prefer = None if self._affinity is None else self._preferred_among
            plan = self._pool.plan(self._model, prefer)
            if self._shared is None:
                backend = next((b for b in plan if b not in self._tried), None)
                held_elsewhere = False
            else:
                backend, self._slot, held_elsewhere = take_slot(self._shared, plan, self._tried)
            if backend is None and (held_elsewhere or self._pool.full(self._model, self._tried)):
                now = time.monotonic()
                again, queued_at = queued_at is not None, queued_at or now
                left = self._limits.queue_s - (now - queued_at)
                if left > 0 and await self._queue.wait(self._model, left, queued_at, again=again):
                    # Time in line is not the failover window's (``queue_s`` bounds it): the
                    # attempt let in has what was left of the window when the wait began.
                    self._began += time.monotonic() - now
                    continue
                raise self._no_room(now - queued_at)
            if backend is None:
                raise self._give_up()
            if len(self._tried) == 1 and not self._relayed_any:
                self._counts.failovers += 1  # once per reply, however many moves it made
            if not self._tried and self._spilled_past_home(backend):
                self._counts.spills += 1
            self._tried.add(backend)
            self._trial = backend.begin()
            self._backend, self._attempt_began = backend, time.monotonic()
            self._flowing = False
            # The head is awaited only while the failover window is open.
            left = self._limits.failover_s - (time.monotonic() - self._began)
            try:
                request = self._attempt_request()
                self._stream = await self._opener(backend, request, max(left, 0.001))
                self._watch()
                return
            except RequestRejected:
                self._attempt_over("rejected")  # the request, not the upstream: no failover
                raise
            except EngineError as exc:
                self._attempt_failed(exc, AT_HEAD.get(exc.code, "connect_error"))
            except BaseException:
                self._attempt_over("cancelled")
                raise

    def _preferred_among(self, usable: list[Backend]) -> Backend:
        """Routed by prefix: the upstream this reply's key goes to among ``usable``."""
        assert self._affinity is not None
        return preferred(usable, self._affinity)

    def _spilled_past_home(self, first: Backend) -> bool:
        """Routed by prefix: whether ``first``, a reply's first upstream, is not its key's
        own among those usable now (that one's load past the bound, or at its limit of
        requests at once, in this worker or counted over every worker's slots)."""
        if self._affinity is None:
            return False
        return first is not home(self._pool.usable(self._model) or [first], self._affinity)

    def _attempt_request(self) -> GenerationRequest:
        """The request as this attempt sends it: after a seam, with the text so far as the
        assistant's prefix and the rest of the token budget."""
        if not self._sent:
            return self._request
        return continued_request(self._request, "".join(self._sent), self._tokens)

    def _give_up(self) -> EngineError:
        error = self._last_error
        if error is None:
            model = "" if self._model is None else f" serving {self._model}"
            problems = "; ".join(
                b.problem or f"{b.name} is failing" for b in self._pool.serving(self._model)
            )
            error = NoUpstream(
                f"no upstream{model} can take a request now (each circuit is open, after "
                f"repeated failures or for as long as its upstream asked): {problems}",
                code="upstream_unavailable",
            )
        elif len(self._tried) > 1:
            error.args = (f"{error} (after trying {len(self._tried)} upstreams)",)
        if error.status == 503:
            # Nobody can take it now (or the last upstream was busy): the client learns when
            # some upstream may, which replaces what an upstream asked of us.
            error.retry_after_s = self._pool.wait_s(self._model)
        return error

    def _no_room(self, waited_s: float) -> UpstreamBusy:
        model = "" if self._model is None else f" serving {self._model}"
        return UpstreamBusy(
            f"every upstream{model} is at its limit of requests at once"
            + (f" (waited {waited_s:.3g} s for room)" if waited_s > 0 else ""),
            code="upstream_busy",
            retry_after_s=1.0,  # a request may end at any moment
        )

    def _attempt_failed(self, error: EngineError, result: str) -> None:
        backend = self._backend
        self._close_stream()
        self._last_error = error
        if backend is not None and error.code not in NOT_ITS_HEALTH:
            self._pool.failed(backend, str(error), error.retry_after_s or 0.0)
        self._attempt_over(result)

    def _attempt_over(self, result: str) -> None:
        backend, self._backend = self._backend, None
        if backend is None:
            return
        if result == "ok":
            backend.ended_well()
        backend.end(self._trial)
        if self._slot is not None:
            slots, index = self._slot
            self._slot = None
            slots.give_back(index)
        if backend.max_outstanding is not None:
            self._queue.ended(backend)
        backend.attempts[result] += 1
        if result != "ok" or len(self._tried) > 1:
            self._log(backend, result)

    def _log(self, backend: Backend, result: str) -> None:
        if access_log.isEnabledFor(logging.INFO):
            line = {
                "request_id": self._request.request_id,
                "upstream": backend.name,
                "attempt": len(self._tried),
                "result": result,
                "ms": round((time.monotonic() - self._attempt_began) * 1000.0, 1),
                "relayed_tokens": self._tokens,
            }
            access_log.info("%s", json.dumps(line))

    def _close_stream(self) -> None:
        self._unwatch()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
