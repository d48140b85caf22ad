"""Which upstream serves a request, and which ones are too sick to try: pure state.

This file decides, for each upstream (a ``Backend``):
- its circuit, as a phase table: ``closed`` (used) opens after ``failures`` consecutive
  failures (a reply that breaks after its first text is one; only one that ends well
  ends the row); ``open`` is skipped until ``cooldown_s`` has passed; then the next request
  sent there is a trial, and the circuit is ``half_open`` while it runs (nothing else goes
  there): the trial's success closes the circuit, its failure opens it for another
  cool-down, and a trial whose client left proves nothing (open again, the next request
  is the trial). An upstream that answers busy and says when to come back (its
  ``Retry-After``, a wait) is taken at its word: its circuit opens at once, however short
  the row, and no request goes there before the wait is over (a row at the threshold still
  keeps it out for the whole cool-down);
- whether its last active health probe answered (a failed probe takes it out of routing
  while another upstream for the model is usable; a passing one changes nothing else);
- which models it serves (from its model list, or as configured), and which it answered a
  chat request for with a 404 lately (``UpstreamPool.not_serving``): it goes last for that
  model, after every other upstream that may take the request (one round trip saved per
  request), until a probe lists the model again, or for ``NOT_SERVED_S`` when no probe
  lists its models at all; it is still asked when no other upstream is left.
And for a request: the upstreams to try, in order (``UpstreamPool.plan``): those serving the
model, usable now and below their limit of requests at once (if they have one), least
outstanding requests per unit of weight first (or first the one the request itself prefers,
routed by prefix: ``upstream_affinity``); ties (every request alone, as under light load) go
by smooth weighted round robin (nginx's), so weights 3 and 1 still split a sequence of
requests 3:1, which only a request's first attempt moves on (a failover takes the next
upstream without shifting where the other requests go); and, when none is, how soon one will be
(``UpstreamPool.wait_s``, a refusal's ``Retry-After``). The clock is passed in; nothing here
awaits.
It must not know HTTP or how a request is sent.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum

from replystream.engine.base import BackendStats
from replystream.stats import LATENCY_BOUNDS

# How long an upstream's 404 for a model keeps it last for that model when nothing else is
# said: a probe that lists its models lifts it at once (the model is back) or renews it (the
# model is still missing), so this bounds it only where probes list nothing (a health path
# other than /models, an upstream probed without a key). Long enough to spare a round trip
# per request, short enough that a model loaded again is soon tried first again.
NOT_SERVED_S = 60.0
# The most models one upstream's 404s are kept for (the oldest go first): an upstream whose
# models are not known is sent whatever model a client names.
NOT_SERVED_LIMIT = 256


class Circuit(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    COOLED = "cooled"  # the cool-down has passed and a trial request goes
    ABANDONED = "abandoned"  # the trial ended with no verdict (its client left)


# (phase, outcome) -> next phase; a failure while closed opens only at the threshold, or when
# its upstream said how long to wait, which ``Backend.failed`` checks before it looks here.
CIRCUIT_TABLE: dict[tuple[Circuit, Outcome], Circuit] = {
    (Circuit.CLOSED, Outcome.SUCCESS): Circuit.CLOSED,
    (Circuit.CLOSED, Outcome.FAILURE): Circuit.OPEN,
    (Circuit.OPEN, Outcome.COOLED): Circuit.HALF_OPEN,
    (Circuit.OPEN, Outcome.SUCCESS): Circuit.CLOSED,  # a request that began before it opened
    (Circuit.OPEN, Outcome.FAILURE): Circuit.OPEN,
    (Circuit.HALF_OPEN, Outcome.SUCCESS): Circuit.CLOSED,
    (Circuit.HALF_OPEN, Outcome.FAILURE): Circuit.OPEN,
    (Circuit.HALF_OPEN, Outcome.ABANDONED): Circuit.OPEN,  # cooled already: the next one tries
}


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failures: int = 3  # consecutive failures that open a circuit
    cooldown_s: float = 10.0  # how long an open circuit is skipped

    def __post_init__(self) -> None:
        if self.failures < 1 or self.cooldown_s <= 0:
            raise ValueError("a circuit needs at least 1 failure and a positive cool-down")


@dataclass(eq=False, slots=True)
class Backend:
    """One upstream's routing state."""

    name: str  # its base URL
    weight: int = 1
    # What it serves, in the order it lists them (empty: not known yet).
    models: tuple[str, ...] = ()
    fixed_models: bool = False  # configured: its model list does not replace them
    # The most requests it is sent at once (None: no limit); at it, it takes no more until
    # one ends, and requests wait for room (``upstream_queue``).
    max_outstanding: int | None = None
    # Its own time limits, for a model slower (or faster) than the rest: the first content
    # of an attempt, and the most between two pieces after it (None: the relay's).
    ttft_s: float | None = None
    stall_s: float | None = None
    circuit: Circuit = Circuit.CLOSED
    failures: int = 0  # consecutive
    reopens_at: float = 0.0  # an open circuit lets its trial through from then on
    trial: bool = False  # the trial request of a half-open circuit is under way
    probe_ok: bool | None = None
    problem: str = "not checked yet"  # what is wrong, in words ("" when nothing is)
    # Whether that is the relay's configuration of it (``EngineError.lasting``).
    problem_lasting: bool = False
    outstanding: int = 0
    current: int = 0  # smooth weighted round robin's running score
    attempts: Counter[str] = field(default_factory=Counter)
    probes: Counter[str] = field(default_factory=Counter)
    # Its time to first text, per attempt that sent text: a count per ``LATENCY_BOUNDS``
    # bucket (the last past them all) and their sum.
    first_text_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    first_text_sum: float = 0.0
    # The models it answered 404 to lately, and until when that stands (``not_serving``).
    unserved: dict[str, float] = field(default_factory=dict)
    connections: int = 0  # opened to it so far (a request on one kept alive opens none)
    # Whether it is sent ``stream_options`` (for its own usage): not once it refused them.
    takes_stream_options: bool = True
    # Whether an assistant message's null content goes to it as null (OpenAI's spelling of a
    # turn of tool calls with no text): not once it refused that, then as an empty string.
    takes_null_content: bool = True
    # The models it takes a token limit for only as ``max_completion_tokens`` (it refused
    # ``max_tokens`` for them, as OpenAI does for its reasoning models), oldest first.
    completion_limit_models: dict[str | None, None] = field(default_factory=dict)

    def connected(self) -> None:
        """A connection to it was opened."""
        self.connections += 1

    def _move(self, outcome: Outcome) -> None:
        self.circuit = CIRCUIT_TABLE[self.circuit, outcome]

    def allows(self, now: float) -> bool:
        """Whether its circuit lets a request through now: closed, or open with its cool-down
        (and its upstream's wait) over: that request is the trial; not while a trial is out."""
        if self.circuit is Circuit.CLOSED:
            return True
        return self.circuit is Circuit.OPEN and now >= self.reopens_at

    @property
    def has_room(self) -> bool:
        """Whether it is below its limit of requests at once."""
        return self.max_outstanding is None or self.outstanding < self.max_outstanding

    def wait_s(self, now: float) -> float:
        """Seconds until its circuit lets a request through: 0 when it does now, or while a
        trial is out (its verdict may come at any moment)."""
        if self.circuit is Circuit.OPEN:
            return max(0.0, self.reopens_at - now)
        return 0.0

    def begin(self) -> bool:
        """A request goes here; whether it is the trial of an open circuit whose cool-down
        is over (what its ``end`` is told)."""
        self.outstanding += 1
        if self.circuit is Circuit.OPEN:
            self._move(Outcome.COOLED)
            self.trial = True
            return True
        return False

    def end(self, trial: bool) -> None:
        """A request here is over (after ``succeeded`` or ``failed``, if it had a verdict);
        ``trial``: it was the trial (``begin`` said so). Only the trial's end without a
        verdict says nothing came of it: a request from before the circuit opened may end
        while the trial is out."""
        self.outstanding -= 1
        if trial and self.trial:  # a trial that proved nothing: the next request is the trial
            self.trial = False
            self._move(Outcome.ABANDONED)

    def answered(self) -> None:
        """An attempt here sent its first text: the circuit closes (a trial passed), but a
        row of failures goes on until a reply ends well (one that breaks mid-reply is one
        more: an upstream that never finishes a reply must still open its circuit)."""
        self.trial = False
        self._move(Outcome.SUCCESS)
        if self.probe_ok is not False:
            self.problem, self.problem_lasting = "", False

    def ended_well(self) -> None:
        """An attempt here ended well (it answered first): the row of failures is over."""
        self.failures = 0

    def succeeded(self) -> None:
        """An attempt here answered and ended well."""
        self.answered()
        self.ended_well()

    def sent_first_text(self, after_s: float) -> None:
        """An attempt's first text came ``after_s`` seconds after the attempt began."""
        self.first_text_counts[bisect_left(LATENCY_BOUNDS, after_s)] += 1
        self.first_text_sum += after_s

    def failed(
        self,
        now: float,
        problem: str,
        breaker: BreakerConfig,
        wait_s: float = 0.0,
        *,
        lasting: bool = False,
    ) -> None:
        """An attempt here failed with ``problem`` (``lasting``: for the relay's configuration
        of it). ``wait_s``: how long its upstream asked to be left alone (its
        ``Retry-After``, bounded by the caller; 0: it did not say)."""
        self.failures += 1
        self.trial = False
        self.problem, self.problem_lasting = problem, lasting
        # Sick, and out for a cool-down: a row long enough, or a failed trial that did not
        # say when to come back. A wait alone is the upstream's word that it is busy (a
        # trial may get one too): out for that long, until the row is long enough.
        sick = self.failures >= breaker.failures or (
            self.circuit is not Circuit.CLOSED and wait_s <= 0
        )
        if not sick and wait_s <= 0:
            return
        if self.circuit is not Circuit.OPEN:  # (open: the request began before it opened)
            self.reopens_at = now + (breaker.cooldown_s if sick else 0.0)
        self.reopens_at = max(self.reopens_at, now + wait_s)
        self._move(Outcome.FAILURE)

    def probed(
        self, problem: str | None, models: Sequence[str] | None, *, lasting: bool = False
    ) -> None:
        """What an active health probe found (None: it answered; ``lasting``: a problem of
        the relay's configuration of it), and the models it lists."""
        self.probe_ok = problem is None
        self.probes["ok" if problem is None else "failed"] += 1
        if problem is not None:
            self.problem, self.problem_lasting = problem, lasting
        elif self.circuit is Circuit.CLOSED:
            self.problem, self.problem_lasting = "", False
        if models and not self.fixed_models:
            self.models = tuple(dict.fromkeys(models))

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models

    def stats(self, now: float) -> BackendStats:
        """Its state at ``now``: an open circuit whose cool-down is over lets its trial
        through, so it is half open, whether or not the trial has been sent yet (unless its
        last probe failed: then requests keep away from it while another can serve)."""
        circuit = self.circuit
        if circuit is Circuit.OPEN and now >= self.reopens_at and self.probe_ok is not False:
            circuit = Circuit.HALF_OPEN
        return BackendStats(
            name=self.name,
            circuit=circuit.value,
            probe_ok=self.probe_ok,
            outstanding=self.outstanding,
            attempts=tuple(sorted(self.attempts.items())),
            probes=tuple(sorted(self.probes.items())),
            first_text_counts=tuple(self.first_text_counts),
            first_text_sum=self.first_text_sum,
            max_outstanding=self.max_outstanding,
            slots_taken=None if self.max_outstanding is None else self.outstanding,
            connections=self.connections,
        )


class UpstreamPool:
    """Every upstream's state, and the order to try them in for a request."""

    def __init__(
        self,
        backends: Sequence[Backend],
        breaker: BreakerConfig,
        clock: Callable[[], float],
        aliases: dict[str, str] | None = None,
        fallbacks: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        if not backends:
            raise ValueError("give at least one upstream")
        self.backends = list(backends)
        self.breaker = breaker
        self.clock = clock
        self.aliases = dict(aliases or {})
        # A model's fallbacks: the models its requests go on to when none of its upstreams
        # can answer them (``upstream_attempts``).
        self.fallbacks = dict(fallbacks or {})
        # ``model_names``' last answer, with the lists, aliases and fallbacks it was made of:
        # asked for by every request, it is made anew only once a probe, a reload or new
        # routes have replaced one of them (an upstream's list is a tuple: replaced, never
        # changed; the routes' dicts are replaced whole).
        self._names: tuple[list[tuple[str, ...]], tuple[object, ...], tuple[str, ...]] | None
        self._names = None

    def model_names(self) -> tuple[str, ...]:
        """Every model some upstream serves; then each model of the routes' that no upstream
        lists now but one of whose fallbacks is served (a reply's request for it goes on to
        them: ``reached_by_fallback``); then the aliases of a model some upstream may serve
        (one it lists, or any while its list is not known) or a fallback reaches: an alias
        for a model nobody lists is a name nobody serves. First, the default: the first model
        the first upstream that lists any lists (vLLM lists its base model before its LoRA
        adapters), what a request for no model is sent as; the rest merged and sorted."""
        lists = [b.models for b in self.backends]
        routes = (self.aliases, self.fallbacks)
        made = self._names
        if (
            made is not None
            and all(was is now for was, now in zip(made[1], routes, strict=True))
            and len(made[0]) == len(lists)
            and all(was is now for was, now in zip(made[0], lists, strict=True))
        ):
            return made[2]
        names = self._merged_names()
        self._names = (lists, routes, names)
        return names

    def _merged_names(self) -> tuple[str, ...]:
        real = sorted(set().union(*(b.models for b in self.backends)))
        default = next((b.models[0] for b in self.backends if b.models), None)
        if default is not None:
            real.remove(default)
            real.insert(0, default)
        listed = set(real)
        by_fallback = sorted(m for m in self.fallbacks if self.reached_by_fallback(m))
        listed.update(by_fallback)
        aliases = (
            a
            for a, model in self.aliases.items()
            if a not in listed and (self.serving(model) or self.reached_by_fallback(model))
        )
        return (*real, *by_fallback, *sorted(aliases))

    def reached_by_fallback(self, model: str | None) -> bool:
        """No upstream serves ``model`` (a real name), and one of its fallbacks is served: a
        reply's request for it goes on to them (an embeddings request does not)."""
        if model is None or self.serving(model):
            return False
        return any(self.serving(fallback) for fallback in self.fallbacks.get(model, ()))

    def resolve(self, model: str | None) -> str | None:
        """The real model name a request's ``model`` (maybe an alias) stands for."""
        return None if model is None else self.aliases.get(model, model)

    def serving(self, model: str | None) -> list[Backend]:
        return [b for b in self.backends if b.serves(model)]

    def plan(
        self,
        model: str | None,
        prefer: Callable[[list[Backend]], Backend] | None = None,
        tried: Collection[Backend] = (),
    ) -> list[Backend]:
        """The upstreams to try for a request for ``model`` (a real name), best first, but
        those it ``tried`` already; empty when none serving it is usable now. ``prefer``
        picks the first among those usable (a request's own preference:
        ``upstream_affinity``) instead of the least loaded. A plan for a request's first
        attempt moves the round robin on; one for a later attempt (a failover) takes the
        upstream the round robin would pick and leaves it where it was, so one request's
        retries do not shift where the others go."""
        usable = [b for b in self.usable(model) if b.has_room and b not in tried]
        if not usable:
            return []
        last = self._not_serving(usable, model)
        if last:  # a 404 for the model lately: tried once nothing else is left to try
            usable = [b for b in usable if b not in last] or last
            last = [] if usable is last else sorted(last, key=lambda b: b.outstanding / b.weight)
        first = self._pick(usable, turn=not tried) if prefer is None else prefer(usable)
        rest = sorted((b for b in usable if b is not first), key=lambda b: b.outstanding / b.weight)
        return [first, *rest, *last]

    def _not_serving(self, backends: list[Backend], model: str | None) -> list[Backend]:
        """Those of ``backends`` that answered 404 for ``model`` lately (``not_serving``)."""
        if model is None or not any(b.unserved for b in backends):
            return []
        now = self.clock()
        return [b for b in backends if b.unserved.get(model, now) > now]

    def not_serving(self, backend: Backend, model: str) -> None:
        """``backend`` answered a chat request for ``model`` 404: it does not serve it, by its
        own word, until a probe lists it again (or ``NOT_SERVED_S`` pass, where none lists)."""
        unserved = backend.unserved
        unserved.pop(model, None)  # the newest last: the oldest go first past the limit
        while len(unserved) >= NOT_SERVED_LIMIT:
            del unserved[next(iter(unserved))]
        unserved[model] = self.clock() + NOT_SERVED_S

    def served(self, backend: Backend, model: str | None) -> None:
        """A chat attempt at ``backend`` for ``model`` ended well: it serves the model again
        (another route's answer says nothing of chat's: ``not_serving``)."""
        if backend.unserved and model is not None:
            backend.unserved.pop(model, None)

    def listed(self, backend: Backend, models: Collection[str]) -> None:
        """A probe found ``backend`` listing ``models``: each model it answered 404 for is
        served again if listed, and still not served (for ``NOT_SERVED_S`` more) if not."""
        if not backend.unserved or not models:
            return
        until = self.clock() + NOT_SERVED_S
        for model in list(backend.unserved):
            if model in models:
                del backend.unserved[model]
            else:
                backend.unserved[model] = until

    def usable(self, model: str | None) -> list[Backend]:
        """The upstreams serving ``model`` a request may go to now, room or not."""
        now = self.clock()
        allowed = [b for b in self.serving(model) if b.allows(now)]
        # A failed probe is a preference: with no other upstream, one is tried anyway (its
        # own error then tells the client what is wrong); an open circuit is a hard stop.
        return [b for b in allowed if b.probe_ok is not False] or allowed

    def _pick(self, usable: list[Backend], *, turn: bool) -> Backend:
        """The least loaded of ``usable``; among those tied, the round robin's next, which
        moves it on only if ``turn``."""
        least = min(b.outstanding / b.weight for b in usable)
        tied = [b for b in usable if b.outstanding / b.weight == least]
        if len(tied) == 1:
            return tied[0]
        if not turn:  # the one a turn would pick (the first of the highest, as ``max`` does)
            return max(tied, key=lambda b: b.current + b.weight)
        total = sum(b.weight for b in tied)
        for b in tied:
            b.current += b.weight
        best = max(tied, key=lambda b: b.current)
        best.current -= total
        return best

    def full(self, model: str | None, excluding: Collection[Backend] = ()) -> bool:
        """Whether the only thing keeping a request for ``model`` out of the upstreams but
        ``excluding`` (those it tried) is their limits of requests at once: some let a
        request through now, and none of those has room (one ending would let it in)."""
        usable = [b for b in self.usable(model) if b not in excluding]
        return bool(usable) and not any(b.has_room for b in usable)

    def most_at_once(self, model: str | None) -> int | None:
        """The most requests for ``model`` the upstreams serving it take at once, their
        limits summed; None when one of them has no limit."""
        total = 0
        for backend in self.serving(model):
            if backend.max_outstanding is None:
                return None
            total += backend.max_outstanding
        return total

    def failed(
        self, backend: Backend, problem: str, wait_s: float = 0.0, *, lasting: bool = False
    ) -> None:
        backend.failed(self.clock(), problem, self.breaker, wait_s, lasting=lasting)

    def wait_s(self, model: str | None) -> float | None:
        """Seconds until some upstream serving ``model`` lets a request through (0: one does
        now); None when none serves it."""
        now = self.clock()
        return min((b.wait_s(now) for b in self.serving(model)), default=None)

    def ready(self) -> tuple[bool, str, float | None]:
        """Whether some upstream can take a request now; if none, what is wrong with each,
        and how soon the first whose last probe answered lets a request through (None: every
        probe failed, and only the next probe round can tell)."""
        now = self.clock()
        for backend in self.backends:
            if backend.probe_ok is not False and (
                backend.circuit is Circuit.HALF_OPEN or backend.allows(now)
            ):
                return True, "", None
        problems = "; ".join(b.problem or f"{b.name} is failing" for b in self.backends)
        waits = [b.wait_s(now) for b in self.backends if b.probe_ok is not False]
        return False, problems, min(waits, default=None)
