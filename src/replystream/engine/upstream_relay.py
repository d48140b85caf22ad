"""One client reply over one or more upstream attempts: failover before the first token,
stall detection and, when the request allows it, continuation after it.

This file decides when an attempt has failed and what happens next:
- Before the first content (the commit point, as for hold-back: nothing but headers and
  keep-alives has reached the client): a connect error, a 5xx or 429, an error in the
  stream, or no content within ``ttft_s`` moves the request to the next upstream of the
  plan, invisibly to the client, until ``failover_s`` has passed since the request began.
  An upstream that refused the request itself (a 400) is not retried elsewhere.
- After it: no content for ``stall_s`` is ``upstream_stalled``; that, or any failure of the
  stream, ends the reply with that error, or, with continuation on, sends the prompt plus
  the text already relayed (as the assistant's prefix, ``continue_final_message``) to the
  next upstream, and the reply goes on from there: an empty marker delta (``continued``)
  first, then the new upstream's text. Nothing relayed is sent twice.
Every attempt's result is counted on its backend and logged (``replystream.access``, one JSON
line each, with the request id). It must not know how an attempt is sent (``Opener``) or
anything about our HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from replystream.engine.base import (
    Delta,
    DeltaStream,
    EngineError,
    GenerationRequest,
    RequestRejected,
)
from replystream.engine.upstream_pool import Backend, UpstreamPool

access_log = logging.getLogger("replystream.access")

# Sends ``request`` to ``backend`` and returns its stream once the response head arrived.
Opener = Callable[[Backend, GenerationRequest], Awaitable[DeltaStream]]


_AT_HEAD = {
    "upstream_timeout": "head_timeout",
    "upstream_overloaded": "overloaded",
    "upstream_error_status": "error_status",
}
_IN_STREAM = {"upstream_ttft_timeout": "ttft_timeout", "upstream_stalled": "stalled"}


class NoUpstream(EngineError):
    """No upstream serving the request can take it now (every circuit open, or none)."""

    status = 503


class RelayStalled(EngineError):
    """An upstream sent no content for too long (before or after the first token)."""

    status = 504


@dataclass(frozen=True, slots=True)
class RelayLimits:
    ttft_s: float = 30.0  # per attempt: the first content within this
    stall_s: float = 60.0  # after it: no content for this long is a stall
    failover_s: float = 60.0  # from the request (or a seam) to giving up on other upstreams

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.stall_s > 0 and self.failover_s > 0):
            raise ValueError("relay timeouts must be positive")


@dataclass(slots=True)
class RelayCounts:
    """What the relay did across replies (read by the engine's ``stats``)."""

    failovers: int = 0
    continuations: int = 0


class RelayedReply:
    """A ``DeltaStream`` over a sequence of upstream attempts."""

    # Thousands are open at once: slots instead of an instance dict.
    __slots__ = (
        "_attempt_began",
        "_backend",
        "_began",
        "_continuation",
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
        "_overdue",
        "_pool",
        "_relayed_any",
        "_request",
        "_seam",
        "_sent",
        "_stream",
        "_text_at",
        "_timer",
        "_tokens",
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
    ) -> None:
        self._request = request
        self._pool = pool
        self._opener = opener
        self._limits = limits
        self._continuation = continuation
        self._counts = counts
        self._model = pool.resolve(request.model)
        self._tried: set[Backend] = set()
        self._began = time.monotonic()  # of the request, or of the latest seam
        self._backend: Backend | None = None
        self._stream: DeltaStream | None = None
        self._attempt_began = 0.0
        self._flowing = False  # the current attempt has relayed content
        self._sent: list[str] = []  # every text relayed, in order (with continuation on)
        self._relayed_any = False
        self._tokens = 0
        self._seam: str | None = None  # why the next attempt continues the reply
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

    def __aiter__(self) -> RelayedReply:
        return self

    async def open(self) -> None:
        """The first attempt that gets a response head.

        Raises:
            RequestRejected: the upstream refused the request itself.
            EngineError: no upstream answered within the failover bound (the last failure).
        """
        await self._next_attempt()

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
                self._text_at = self._loop.time()
                return self._relayed(delta)
            finally:
                self._waiter, self._overdue = None, False
            await self._attempt_failed(error, _IN_STREAM.get(error.code, "stream_error"))
            if not flowing:
                continue  # the next attempt, or the last failure raised by it
            if not self._continuation:
                raise error
            self._seam = error.code  # the next attempt continues the text relayed so far
            self._counts.continuations += 1
            self._began = time.monotonic()

    def _watch(self) -> None:
        """Once per attempt: the watchdog that notices no text for ``_limit`` seconds.

        One timer per attempt rather than a timeout per delta (``asyncio.timeout`` costs
        several microseconds per chunk): each delta only stamps ``_text_at``, and the timer,
        when it fires early, sets itself again for the new due time."""
        self._loop = asyncio.get_running_loop()
        self._text_at = self._loop.time()
        self._limit = self._ttft_limit()
        self._timer = self._loop.call_at(self._text_at + self._limit, self._check)

    def _check(self) -> None:
        due = self._text_at + self._limit
        if self._loop.time() < due or self._waiter is None:  # text came, or nobody waits
            later = max(due, self._loop.time() + min(self._limit, 0.1))
            self._timer = self._loop.call_at(later, self._check)
            return
        self._overdue = True
        self._waiter.cancel()
        self._timer = None

    def _unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _relayed(self, delta: Delta) -> Delta:
        if not self._flowing:
            self._flowing = True
            self._limit = self._limits.stall_s  # from now on: the stall limit, from here
            self._unwatch()
            self._timer = self._loop.call_at(self._text_at + self._limit, self._check)
            assert self._backend is not None
            self._backend.succeeded()
        if delta.tool_call is not None:
            # A continuation sends the text so far as the assistant's prefix; a call cannot be
            # sent that way, so a reply that made one ends with its error instead.
            self._continuation = False
        if self._continuation:  # kept only for a continuation's prefix
            self._sent.append(delta.text)
        self._relayed_any = True
        self._tokens += delta.tokens
        if delta.finish_reason is not None:
            self._done = True
            self._unwatch()
            self._attempt_over("ok")
        if self._seam is None:
            return delta
        # The client learns where the text comes from a new upstream, then reads it.
        self._held, reason, self._seam = delta, self._seam, None
        return Delta("", 0, delta.made_at, continued=reason)

    def _ttft_limit(self) -> float:
        left = self._limits.failover_s - (time.monotonic() - self._began)
        return max(0.001, min(self._limits.ttft_s, left))

    def _timed_out(self, limit: float, flowing: bool) -> EngineError:
        where = "the upstream" if self._backend is None else f"the upstream at {self._backend.name}"
        if flowing:
            return RelayStalled(
                f"{where} sent no text for {limit:g} s mid-reply", code="upstream_stalled"
            )
        return RelayStalled(
            f"{where} sent no text within {limit:g} s", code="upstream_ttft_timeout"
        )

    async def _next_attempt(self) -> None:
        """Open the next upstream of the plan that answers; raise when none is left."""
        while True:
            if self._tried and time.monotonic() - self._began >= self._limits.failover_s:
                raise self._give_up()
            backend = next((b for b in self._pool.plan(self._model) if b not in self._tried), None)
            if backend is None:
                raise self._give_up()
            if self._tried and not self._relayed_any:
                self._counts.failovers += 1
            self._tried.add(backend)
            backend.begin()
            self._backend, self._attempt_began = backend, time.monotonic()
            self._flowing = False
            try:
                self._stream = await self._opener(backend, self._attempt_request())
                self._watch()
                return
            except RequestRejected:
                self._attempt_over("rejected")  # the request, not the upstream: no failover
                raise
            except EngineError as exc:
                await self._attempt_failed(exc, _AT_HEAD.get(exc.code, "connect_error"))
            except BaseException:
                self._attempt_over("cancelled")
                raise

    def _attempt_request(self) -> GenerationRequest:
        """The request as this attempt sends it: after a seam, with the text so far as the
        assistant's prefix and the rest of the token budget."""
        if not self._sent:
            return self._request
        request, prefix = self._request, "".join(self._sent)
        messages = request.messages or ({"role": "user", "content": request.prompt},)
        if request.prefix:  # the client's own prefix, continued already: extend it
            *before, last = messages
            messages = (*before, {**last, "content": request.prefix + prefix})
            prefix = request.prefix + prefix
        else:
            messages = (*messages, {"role": "assistant", "content": prefix})
        sampling = request.sampling
        if sampling.max_tokens is not None:
            sampling = replace(sampling, max_tokens=max(1, sampling.max_tokens - self._tokens))
        return replace(request, messages=tuple(messages), prefix=prefix, sampling=sampling)

    def _give_up(self) -> EngineError:
        error = self._last_error
        if error is None:
            model = "" if self._model is None else f" serving {self._model}"
            problems = "; ".join(
                b.problem or f"{b.name} is failing" for b in self._pool.serving(self._model)
            )
            return NoUpstream(
                f"no upstream{model} can take a request now (their circuits are open after "
                f"repeated failures): {problems}",
                code="upstream_unavailable",
            )
        if len(self._tried) > 1:
            error.args = (f"{error} (after trying {len(self._tried)} upstreams)",)
        return error

    async def _attempt_failed(self, error: EngineError, result: str) -> None:
        backend = self._backend
        await self._close_stream()
        self._last_error = error
        if backend is not None:
            self._pool.failed(backend, str(error))
        self._attempt_over(result)

    def _attempt_over(self, result: str) -> None:
        backend, self._backend = self._backend, None
        if backend is None:
            return
        backend.end()
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

    async def _close_stream(self) -> None:
        self._unwatch()
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                async with asyncio.timeout(1.0):
                    await asyncio.shield(stream.aclose())
            except (TimeoutError, EngineError):
                pass

    async def aclose(self) -> None:
        """Stop relaying: close the current attempt's upstream connection."""
        self._done = True
        self._held = None
        await self._close_stream()
        self._attempt_over("cancelled")
