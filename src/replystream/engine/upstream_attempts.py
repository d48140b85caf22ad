"""The attempts of one relayed reply: which upstream each goes to, and what each one's end
counts.

This file decides, for each attempt a reply (``upstream_relay.RelayedReply``) makes: the
upstream it goes to, the first of the pool's plan for its model (with the reply's
preference, when routed by prefix: ``upstream_affinity``) not tried yet; when none is left,
or every one left is at its limit of requests at once, the next model of the model's
fallbacks (the routes file's: ``UpstreamPool.fallbacks``), sent as that model, its upstreams
untried; that no upstream is left once ``failover_s`` has passed since the request began (or
since its latest seam), and what the reply then ends with: the last attempt's failure, or,
when none could be tried, a 503 that says when some upstream may take a request
(``retry_after_s``). When every upstream left of the last model is at its limit of requests
at once, the request waits for room (``upstream_queue``) for at most ``queue_s``, then is
``upstream_busy`` (503); a choice of a request of several takes
room with those of its choices not started yet, all or none (``upstream_admission``). With
``shared`` limits (the workers of one server), an attempt at an upstream with a limit also
holds one of its slots (``upstream_slots``) from the moment it is chosen to its end, however
it ends; an upstream whose slots the other workers hold is passed over as one at its limit.
An upstream that refused the request itself (a 400) is not retried elsewhere (but one that
said it is past its model's context, ``ContextTooLong``, goes on to a fallback model); one that
answered 404 (it does not serve the model) goes last for that model in later plans
(``upstream_pool``); any other failure at the head is counted on that upstream's circuit
(but for what it says of the request, not of the upstream: ``NOT_ITS_HEALTH``; a busy
upstream's ``Retry-After`` keeps its circuit open at least that long: ``upstream_pool``) and
the next upstream is tried. Every attempt's result is counted on its backend and logged
(``replystream.access``, one JSON line each, with the request id). What an attempt sends
after a seam is ``upstream_continuation``'s.

It must not know how an attempt is read, when one failed mid-stream or what happens then
(``upstream_relay``), how an attempt is sent (``Opener``), or anything about our HTTP
server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from replystream.engine.base import EngineError, GenerationRequest, RequestRejected
from replystream.engine.upstream_admission import ChoiceRoom, Hold, room, take_one, take_room
from replystream.engine.upstream_affinity import home, preferred
from replystream.engine.upstream_continuation import continued_request
from replystream.engine.upstream_pool import Backend, UpstreamPool
from replystream.engine.upstream_queue import RoomQueue
from replystream.engine.upstream_refusals import ContextTooLong
from replystream.engine.upstream_relay_types import (
    AT_HEAD,
    NOT_ITS_HEALTH,
    Attempt,
    FirstContentLate,
    NoUpstream,
    Opener,
    RelayCounts,
    RelayLimits,
    RelayStalled,
    UpstreamBusy,
)
from replystream.engine.upstream_slots import SharedLimits

access_log = logging.getLogger("replystream.access")


class AttemptSeries:
    """One reply's attempts, one after another: the current one's upstream, stream and
    timer, what was relayed so far, and the opening and end of each attempt."""

    # Thousands are open at once: slots instead of an instance dict.
    __slots__ = (
        "_affinity",
        "_attempt_began",
        "_attempt_from",
        "_attempts",
        "_backend",
        "_began",
        "_choices",
        "_counts",
        "_fallbacks",
        "_flowing",
        "_hold",
        "_last_error",
        "_limits",
        "_model",
        "_on_admitted",
        "_opener",
        "_pool",
        "_queue",
        "_relayed_any",
        "_request",
        "_sent",
        "_shared",
        "_stream",
        "_timer",
        "_tokens",
        "_tried",
    )

    def __init__(
        self,
        request: GenerationRequest,
        *,
        pool: UpstreamPool,
        opener: Opener,
        limits: RelayLimits,
        counts: RelayCounts,
        queue: RoomQueue,
        affinity: str | None = None,
        shared: SharedLimits | None = None,
        choices: ChoiceRoom | None = None,
    ) -> None:
        self._request = request
        self._pool = pool
        self._queue = queue
        # With workers: the limits all of them hold together.
        self._shared = shared
        # The room of the current attempt, and, for a choice of a request of several, the
        # room taken for the choices not started yet.
        self._hold: Hold | None = None
        self._choices = choices
        # Routed by prefix: the upstream its key prefers goes first (else the least loaded).
        self._affinity = affinity
        self._opener = opener
        self._limits = limits
        self._counts = counts
        self._model = pool.resolve(request.model)
        # The models its requests go on to, in order, when none of the current one's
        # upstreams can answer (``_fall_back``); the first is the model asked for.
        chain = () if self._model is None else pool.fallbacks.get(self._model, ())
        self._fallbacks = (self._model, *chain)
        self._tried: set[Backend] = set()  # the current model's upstreams tried
        self._attempts = 0  # over every model
        self._began = time.monotonic()  # of the request, or of the latest seam
        self._backend: Backend | None = None
        self._stream: Attempt | None = None
        self._attempt_began = 0.0
        self._flowing = False  # the current attempt has relayed content
        self._sent: list[str] = []  # every text relayed, in order (with continuation on)
        self._relayed_any = False
        self._tokens = 0
        self._attempt_from = 0  # of ``_tokens``, those relayed before the current attempt
        # The current attempt's watchdog timer (the reading reply's: ``upstream_relay``).
        self._timer: asyncio.TimerHandle | None = None
        self._last_error: EngineError | None = None
        self._on_admitted: Callable[[], None] | None = None  # ``when_admitted``'s, until then

    def when_admitted(self, call: Callable[[], None]) -> None:
        """Call ``call`` once, when the request is first sent to an upstream (it took room
        there): now, if it was (``start`` waits for that but for a background request)."""
        if self._attempts:
            call()
        else:
            self._on_admitted = call

    async def _next_attempt(self) -> None:
        """Open the next upstream of the plan that answers, waiting for room when those left
        are at their limit of requests at once; raise when none is left."""
        queued_at: float | None = None
        while True:
            if self._attempts and time.monotonic() - self._began >= self._limits.failover_s:
                raise self._give_up()
            if queued_at is None and self._behind_a_starving_request():
                hold, full = None, True  # in line behind it, not taking the room it gathers
            else:
                hold, full = self._take_room(queued_at or time.monotonic())
            if hold is None and full and self._fall_back():
                continue  # its fallback now, rather than wait in line for this model
            if hold is None and full and self._others_wait_for_this():
                # In line, it would hold their room while it waited for more: it ends now.
                raise self._no_room(0.0) if self._last_error is None else self._give_up()
            if hold is None and full:
                now = time.monotonic()
                again, queued_at = queued_at is not None, queued_at or now
                left = self._limits.queue_s - (now - queued_at)
                if left > 0 and await self._queue.wait(
                    self._model, left, queued_at, again=again, fits=self._fits()
                ):
                    # Time in line is not the failover window's (``queue_s`` bounds it): the
                    # attempt let in has what was left of the window when the wait began.
                    self._began += time.monotonic() - now
                    continue
                raise self._no_room(time.monotonic() - queued_at)
            if hold is None:
                if self._fall_back():
                    continue
                raise self._give_up()
            backend = hold.backend
            if self._attempts == 1 and not self._relayed_any:
                self._counts.failovers += 1  # once per reply, however many moves it made
            self._tried.add(backend)
            self._attempts += 1
            admitted, self._on_admitted = self._on_admitted, None
            if admitted is not None:  # out of the line: sent upstream from here
                admitted()
            self._hold = hold
            self._backend, self._attempt_began = backend, time.monotonic()
            self._attempt_from = self._tokens
            self._flowing = False
            # The time to the first content counts from here, the head's wait included: an
            # upstream slow to answer at all goes the way of one slow to write.
            limit = self._ttft_limit()
            try:
                request = self._attempt_request()
                self._stream = await self._opener(backend, request, limit)
                return
            except RequestRejected as exc:
                self._attempt_over("rejected", exc)  # the request, not the upstream: no failover
                if isinstance(exc, ContextTooLong) and self._fall_back():
                    self._last_error = exc
                    continue  # but a fallback's model, of a longer context, may take it
                raise
            except FirstContentLate:  # the head's wait used up the time to the first content
                self._attempt_failed(self._timed_out(limit, False), "ttft_timeout")
            except EngineError as exc:
                self._attempt_failed(exc, AT_HEAD.get(exc.code, "connect_error"))
            except BaseException:
                self._attempt_over("cancelled")
                raise

    def _fall_back(self) -> bool:
        """Go on to the next of the request's fallbacks (its upstreams, none tried yet), if
        one is left and the failover window is not over."""
        at = self._fallbacks.index(self._model)
        if at + 1 == len(self._fallbacks):
            return False
        if time.monotonic() - self._began >= self._limits.failover_s:
            return False
        self._go_on_to(self._fallbacks[at + 1])
        if self._choices is not None:  # the room taken for the model before
            self._choices.give_back(self._queue)
        return True

    def _go_on_to(self, model: str | None) -> None:
        """Send the attempts from now on to ``model``, one of the request's fallbacks."""
        if self._model == self._fallbacks[0]:
            self._counts.fallbacks += 1  # once per reply, however far along it goes
        self._model = model
        self._tried = set()

    def _take_room(self, since: float) -> tuple[Hold | None, bool]:
        """Room for the next attempt (counted at its upstream), or None and whether only the
        limits keep it out. While some of its request's choices have not started, it is
        taken with theirs, all or none (``upstream_admission``): a choice's first attempt
        uses the room taken for it, if some was. ``since``: when it began to wait in line
        (now, if it has not): room another worker holds for a request that began earlier is
        not taken."""
        prefer = None if self._affinity is None else self._preferred_among
        choices = self._choices
        if choices is None or not choices.starting:
            backend, slot, full = take_one(
                self._pool, self._shared, self._model, prefer, self._tried, since
            )
            if backend is None:
                return None, full
            self._count_spill(backend)
            return Hold(backend, slot), False
        if (
            choices.holds
            and choices.model != self._model
            and not self._attempts
            and choices.model in self._fallbacks
        ):
            # A choice before it went on to a fallback and took room there for this one too:
            # it starts there (its own model's upstreams could not take that one either).
            self._go_on_to(choices.model)
        if self._tried or not choices.holds or choices.model != self._model:
            # For this one and those not started yet.
            choices.give_back(self._queue)
            count = 1 + choices.unstarted
            holds = take_room(
                self._pool, self._shared, self._model, count, prefer, self._tried, since
            )
            if holds is None:
                return None, True
            choices.holds, choices.model = holds, self._model
        if not choices.holds:
            return None, False
        hold = choices.holds.pop(0)
        self._count_spill(hold.backend)
        return hold, False

    def _fits(self) -> Callable[[], bool] | None:
        """While this attempt waits in line: whether there is room enough to let it in now,
        when it needs more than one (its request's choices not started yet, too); None
        when any room is."""
        choices = self._choices
        if choices is None or not choices.starting:
            return None
        pool, shared, model, tried = self._pool, self._shared, self._model, set(self._tried)
        count = 1 + choices.unstarted

        def fits() -> bool:
            if tried and not room(pool, shared, model, 1, tried):
                return False  # none where this attempt has not been yet
            return room(pool, shared, model, count) >= count

        return fits

    def _behind_a_starving_request(self) -> bool:
        """Whether this attempt, new (not a failover, not starting in room its request took
        already), comes while a request of several choices for its model starves in line."""
        choices = self._choices
        if self._attempts or (choices is not None and choices.holds):
            return False
        return self._queue.holds_room_for(self._model)

    def _others_wait_for_this(self) -> bool:
        """Whether choices of its request were sent already and wait for this one to be:
        they are read, and their room given back as they end, only once all are sent."""
        choices = self._choices
        return choices is not None and 0 < choices.sent < self._request.choices

    def _count_spill(self, first: Backend) -> None:
        if not self._attempts and self._spilled_past_home(first):
            self._counts.spills += 1

    def _own_ttft_s(self) -> float:
        """The current attempt's upstream's time to its first content, else the relay's."""
        backend = self._backend
        return self._limits.ttft_s if backend is None or backend.ttft_s is None else backend.ttft_s

    def _ttft_limit(self) -> float:
        """The current attempt's time to its first content, from its start (its head's wait
        included): its upstream's own limit, if it has one, else the relay's; no later than
        the failover window's end."""
        left = self._limits.failover_s - (self._attempt_began - self._began)
        return max(0.001, min(self._own_ttft_s(), left))

    def _timed_out(self, limit: float, flowing: bool) -> EngineError:
        """The current attempt's failure when ``limit`` passed without content: before the
        first (its head's wait included), or mid-reply (``flowing``)."""
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
        request = self._request
        if self._model != self._fallbacks[0]:  # a fallback's upstream: sent its model
            request = replace(request, model=self._model)
        if not self._sent:
            return request
        return continued_request(request, "".join(self._sent), self._tokens)

    def _give_up(self) -> EngineError:
        return gave_up(self._pool, self._fallbacks, self._last_error, self._attempts)

    def _no_room(self, waited_s: float) -> UpstreamBusy:
        return no_room(self._fallbacks, self._limits.queue_s, waited_s)

    def _attempt_failed(self, error: EngineError, result: str) -> None:
        backend = self._backend
        self._close_stream()
        self._last_error = error
        if backend is not None and error.code not in NOT_ITS_HEALTH:
            self._pool.failed(
                backend, str(error), error.retry_after_s or 0.0, lasting=error.lasting
            )
        elif (
            backend is not None
            and error.code == "model_not_found"
            and self._model is not None
            and not self._request.raw_prompt
        ):
            # Its own word that it lacks the model: the next requests for it go elsewhere
            # first, rather than spend a round trip each to hear it again. Not from a legacy
            # completion's 404: a route besides chat may lack a model chat serves (OpenAI's
            # "This is a chat model and not supported in the v1/completions endpoint").
            self._pool.not_serving(backend, self._model)
        self._attempt_over(result, error)

    def _attempt_over(self, result: str, error: EngineError | None = None) -> None:
        backend, self._backend = self._backend, None
        if backend is None:
            return
        if result == "ok":
            backend.ended_well()
            if not self._request.raw_prompt:  # (chat's word on the model, as ``not_serving``)
                self._pool.served(backend, self._model)
        hold, self._hold = self._hold, None
        assert hold is not None
        hold.give_back(self._queue)
        backend.attempts[result] += 1
        if result != "ok" or self._attempts > 1 or self._model != self._fallbacks[0]:
            self._log(backend, result, error)

    def _log(self, backend: Backend, result: str, error: EngineError | None) -> None:
        # This attempt's own, as ``ms`` is: after a seam, the tokens before it are another's.
        more: dict[str, object] = {"relayed_tokens": self._tokens - self._attempt_from}
        if self._model != self._fallbacks[0]:
            more["model"] = self._model  # a fallback's
        if error is not None:
            # Why, in the words a client would get (keys withheld): a failure the next
            # attempt rescued reaches no client, and its line is all that tells of it.
            more["error"], more["reason"] = error.code, str(error)
        log_attempt(
            self._request.caller.request_id,
            backend,
            self._attempts,
            result,
            self._attempt_began,
            more,
        )

    def _close_stream(self) -> None:
        self._unwatch()
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


# What a request's attempts end with, for a reply's (``AttemptSeries``) and an embeddings
# request's (``upstream_embeddings``) alike. ``models``: the model asked for, then the ones it
# may go on to (None: any upstream).


def serving(models: Sequence[str | None]) -> str:
    """`` serving M`` (`` serving M or its fallbacks F, G``) for an error's words."""
    asked, *fallbacks = models
    if asked is None:
        return ""
    if not fallbacks:
        return f" serving {named(asked)}"
    return f" serving {named(asked)} or its fallbacks {', '.join(map(named, fallbacks))}"


# More than any model's name has (a Hugging Face repository's is at most 96 characters).
NAME_SHOWN = 256


def named(model: str | None) -> str:
    """A model's name as words show it: as it is, or quoted when it holds a character that is
    not printable (a client's name, sent as named to an upstream that lists none, may hold a
    line break, which would forge a line of the log these words go to), and cut, quoted, past
    ``NAME_SHOWN`` characters (such a name may be as long as a body is: the warning that
    repeats a refusal would write a line that long for each request)."""
    text = str(model)
    if len(text) > NAME_SHOWN:
        return f"{text[:NAME_SHOWN]!r}… ({len(text)} characters)"
    return text if text.isprintable() else repr(text)


def gave_up(
    pool: UpstreamPool,
    models: Sequence[str | None],
    last_error: EngineError | None,
    attempts: int,
) -> EngineError:
    """What a request ends with when no upstream is left to try: the last attempt's failure
    (naming how many were tried), or, when none could be tried, that every circuit is open,
    or that none serving ``models`` is left in the routes; a 503 says when some upstream
    serving ``models`` may take a request, and a failure is ``lasting`` when each upstream
    serving them is failing for the relay's configuration of it."""
    error = last_error
    serving_them = [b for b in pool.backends if any(b.serves(model) for model in models)]
    if error is None and not serving_them:
        # Served when the request came: the routes file read again while it waited in line
        # took its upstreams out (or they list the model no more).
        error = NoUpstream(
            f"no upstream{serving(models)} is left: the routes changed while the request "
            "waited for room (or its upstreams list it no more)",
            code="upstream_unavailable",
        )
    elif error is None:
        problems = "; ".join(b.problem or f"{b.name} is failing" for b in serving_them)
        error = NoUpstream(
            f"no upstream{serving(models)} can take a request now (each circuit is open, after "
            f"repeated failures or for as long as its upstream asked): {problems}",
            code="upstream_unavailable",
        )
    elif attempts > 1:
        error.args = (f"{error} (after trying {attempts} upstreams)",)
    if error.status >= 500:
        # Asking again helps only if some upstream's trouble may pass: not when each one
        # serving the model last failed for what this relay is configured with (the last
        # attempt's failure among them: this relay's own shortage counts on no upstream).
        error.lasting = (
            (last_error is None or last_error.lasting)
            and bool(serving_them)
            and all(b.problem_lasting for b in serving_them)
        )
    if error.status == 503:
        # Nobody can take it now (or the last upstream was busy): the client learns when
        # some upstream may, which replaces what an upstream asked of us.
        waits = (pool.wait_s(model) for model in models)
        error.retry_after_s = min((s for s in waits if s is not None), default=None)
    return error


def no_room(models: Sequence[str | None], queue_s: float, waited_s: float) -> UpstreamBusy:
    """Every upstream serving ``models`` stayed at its limit of requests at once."""
    return UpstreamBusy(
        f"every upstream{serving(models)} is at its limit of requests at once"
        + (f" (waited {waited_s:.3g} s for room)" if queue_s > 0 else ""),
        code="upstream_busy",
        retry_after_s=1.0,  # a request may end at any moment
    )


def log_attempt(
    request_id: str,
    backend: Backend,
    attempt: int,
    result: str,
    began: float,
    more: dict[str, object] | None = None,
) -> None:
    """An attempt's access-log line (``replystream.access``), with ``more`` fields."""
    if access_log.isEnabledFor(logging.INFO):
        line: dict[str, object] = {
            "request_id": request_id,
            "upstream": backend.name,
            "attempt": attempt,
            "result": result,
            "ms": round((time.monotonic() - began) * 1000.0, 1),
        }
        if more:
            line.update(more)
        access_log.info("%s", json.dumps(line))
