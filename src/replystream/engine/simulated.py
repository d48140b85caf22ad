"""A seeded stand-in for a model: a fixed reply, one word per token, on a timed schedule.

This file decides the timing of a simulated reply: an optional time before the first token
(queueing plus a prefill that grows with the prompt) and then one token every ``d ± j`` ms.
Each delay is a hash of the request's seed (else the configured one: the lab's simulator is
reproducible) and the token's index, so the same seed gives the same schedule and a stream
keeps no random generator and no precomputed schedule.
Each token is due at a fixed deadline measured from the start (not "sleep d after the last
token"), so a timer that fires late does not push every later token back. A stream can be
iterated (one timer per token) or attached to a sink; attached streams share one timer, so
thousands of concurrent replies cost one wake-up per tick instead of one per token each, and
a stream's overdue tokens are delivered together.
Asked for log probabilities, it makes them up, deterministically: each token's is a hash of
the seed and its index (a probability from 0.5 to 1), and the alternatives are the reply's
other words with smaller ones. They are for clients and tests that need the shape without a
model, and say nothing about any model.
It must not know about HTTP or about who reads the tokens.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from replystream.engine.base import (
    Delta,
    DeltaSink,
    EngineError,
    EngineStats,
    GenerationRequest,
    InProcessEngine,
    RequestRejected,
    TokenLogprob,
    TopLogprob,
)
from replystream.engine.reply_script import ReplyScript

# 120 words: the lab's default reply, one word per token as in the reference experiment.
DEFAULT_REPLY = (
    "A language model does not write its answer at once. It reads the prompt, "
    "then makes the reply one token at a time, and each new token depends on every token before "
    "it. The first piece exists after a single step, while the last piece exists only after "
    "the final step. A server can wait for the end and send everything together, or send "
    "each piece the moment it is made. Waiting shows a blank screen for the whole generation. "
    "Streaming shows the first words after about one step and keeps the text growing while "
    "the rest is made. Both finish at nearly the same time, because the model does the same "
    "work in the same order. Only timing differs."
)

ARTICLE_REPLY = "A model does not write the whole answer at once. It makes it one piece at a time."


def split_words(text: str) -> list[str]:
    """Split a reply into word tokens, each keeping the space that follows it."""
    return [word + " " for word in text.split()]


def reply_of_length(text: str, tokens: int) -> str:
    """``text`` cut or repeated word by word to exactly ``tokens`` words."""
    words = text.split()
    if tokens < 1 or not words:
        raise ValueError("need at least one token and one word")
    return " ".join(words[i % len(words)] for i in range(tokens))


_MASK64 = (1 << 64) - 1


def token_draw(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for token ``index`` of the reply seeded ``seed``.

    The ``index``-th output of SplitMix64 started at ``seed``: a pure function of the pair, so
    a stream, one of thousands open at once, keeps where it is in its schedule, not a random
    generator (2.5 KB) or the whole schedule (480 bytes for 120 tokens as 4-byte floats).
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


_LOGPROB_SALT = 0x5EED_1067_9B0B  # another stream of draws than the schedule's


def simulated_logprob(words: list[str], seed: int, index: int, top: int) -> TokenLogprob:
    """A made-up, deterministic log probability for token ``index`` (``words[index]``), with
    ``top`` alternatives: itself first, then the reply's other words, each less likely."""
    word = words[index]
    chance = 0.5 + 0.5 * token_draw(seed ^ _LOGPROB_SALT, index)  # [0.5, 1)
    made = TopLogprob(word, math.log(chance), word.encode())
    others = [w for w in dict.fromkeys(words) if w and w != word]  # a script's calls: ""
    rest = (1.0 - chance) / 2.0
    alternatives = [made]
    for other in others[: max(0, top - 1)]:
        alternatives.append(TopLogprob(other, math.log(rest), other.encode()))
        rest /= 2.0
    return TokenLogprob(word, made.logprob, made.bytes, tuple(alternatives[:top]))


@dataclass(frozen=True, slots=True)
class SimulatedConfig:
    """Timing and content of simulated replies (the reference lab's defaults)."""

    reply_text: str = DEFAULT_REPLY
    delay_ms: float = 33.0
    jitter_ms: float = 8.0
    seed: int = 42
    first_token_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    fail_after: int | None = None
    script: ReplyScript | None = None  # text and tool calls to make instead of reply_text

    def __post_init__(self) -> None:
        if not split_words(self.reply_text):
            raise ValueError("reply_text must contain at least one word")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError("need delay_ms >= jitter_ms >= 0")
        if self.first_token_ms < 0 or self.prefill_ms_per_token < 0:
            raise ValueError("first_token_ms and prefill_ms_per_token must be >= 0")
        if self.fail_after is not None and self.fail_after < 0:
            raise ValueError("fail_after must be >= 0")


class SimulatedEngine(InProcessEngine):
    """Makes the configured reply on a seeded schedule; counts every step it actually runs.

    ``fail_after=N`` injects a failure for testing clients: ``N == 0`` fails before the first
    token (at admission), ``N > 0`` fails after N tokens were made.
    """

    name = "simulated"
    pushes = True  # its streams share one timer and push to a sink
    queues = False  # a reply is at work from its start (its first token's wait included)
    makes_tool_calls = False  # only a scripted reply has calls (``ScriptedEngine``)

    def __init__(self, config: SimulatedConfig | None = None) -> None:
        self.config = config or SimulatedConfig()
        self._words = split_words(self.config.reply_text)
        self._low_ms = self.config.delay_ms - self.config.jitter_ms
        self._span_ms = 2.0 * self.config.jitter_ms
        self._started = 0
        self._finished = 0
        self._cancelled = 0
        self._failed = 0
        self._active = 0
        self._steps = 0
        self._ticker: _Ticker | None = None

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt(self, request: GenerationRequest) -> int:
        # Its deltas carry no count of their own: the usage is the server's, this one.
        return self.count_tokens(request.prompt)

    def schedule(self, request: GenerationRequest) -> list[float]:
        """Seconds from the start at which each token of this request is due."""
        seed = self.seed_for(request)
        due_ms = self._first_token_ms(request)
        due = []
        words = self._words
        for index in range(self._start_of(request, words), self._reply_length(request, words)):
            due_ms += self._gap_ms(seed, index)
            due.append(due_ms / 1000.0)
        return due

    def seed_for(self, request: GenerationRequest) -> int:
        """The request's seed, else the configured one: the lab's simulator stays reproducible."""
        return self.config.seed if request.sampling.seed is None else request.sampling.seed

    def _first_token_ms(self, request: GenerationRequest) -> float:
        """Queueing and prefill: the time before the first token's own delay."""
        cfg = self.config
        return cfg.first_token_ms + cfg.prefill_ms_per_token * self.count_tokens(request.prompt)

    def _gap_ms(self, seed: int, index: int) -> float:
        """The delay before token ``index``: uniform in ``delay_ms ± jitter_ms``."""
        return self._low_ms + self._span_ms * token_draw(seed, index)

    @staticmethod
    def _reply_length(request: GenerationRequest, words: list[str]) -> int:
        """Where the reply of ``words`` ends: all of them, or ``max_tokens`` after where it
        starts."""
        limit, start = request.sampling.max_tokens, SimulatedEngine._start_of(request, words)
        return len(words) if limit is None else min(start + limit, len(words))

    @staticmethod
    def _start_of(request: GenerationRequest, words: list[str]) -> int:
        """The word a reply starts at: after as many words as the prefix to continue has
        (a relay continuing a cut reply here gets the rest of the same text)."""
        return min(len(request.prefix.split()), len(words))

    async def start(self, request: GenerationRequest) -> SimulatedStream:
        return self._open(request, self)

    def _open(self, request: GenerationRequest, reply: TokenSource) -> SimulatedStream:
        """A stream of ``reply``'s tokens for ``request``, counted as this engine's."""
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1", param="max_tokens")
        if self.config.fail_after == 0:
            self._failed += 1
            raise EngineError("simulated failure before the first token")
        self._started += 1
        self._active += 1
        loop = asyncio.get_running_loop()
        if self._ticker is None:
            self._ticker = _Ticker(loop)
        seed = self.seed_for(request)
        return SimulatedStream(
            self,
            seed,
            self._reply_length(request, reply._words),
            self._first_token_ms(request),
            loop.time(),
            request.sampling.logprobs,
            first=self._start_of(request, reply._words),
            reply=reply,
        )

    def _token(self, index: int, count: int, made_at: float) -> Delta:
        """Token ``index`` of a reply of ``count`` tokens, counted as one step."""
        self._steps += 1
        finish = None
        if index == count - 1:
            finish = "length" if count < len(self._words) else "stop"
        return Delta(self._words[index], 1, made_at, finish)

    def _ended(self, outcome: str) -> None:
        self._active -= 1
        if outcome == "finished":
            self._finished += 1
        elif outcome == "failed":
            self._failed += 1
        else:
            self._cancelled += 1

    def stats(self) -> EngineStats:
        return EngineStats(
            started=self._started,
            finished=self._finished,
            cancelled=self._cancelled,
            failed=self._failed,
            active=self._active,
            steps=self._steps,
        )

    async def aclose(self) -> None:
        """Nothing to release: a stream holds only its schedule."""


class TokenSource(Protocol):
    """What a stream makes its tokens of: a reply's words (its length), each token's delay,
    each token. The simulated engine is one; a scripted reply another (``ScriptedReply``)."""

    _words: list[str]

    def _gap_ms(self, seed: int, index: int) -> float: ...

    def _token(self, index: int, count: int, made_at: float) -> Delta: ...


class ScriptedReply:
    """A script as a stream replays it: its deltas, on their own delays where it gives them
    (else its engine's seeded ones), counted as its engine's steps."""

    __slots__ = ("_engine", "_plan", "_words", "script")

    def __init__(self, engine: ScriptedEngine, script: ReplyScript) -> None:
        self._engine = engine
        self.script = script
        self._plan = script.deltas
        self._words = [step.text for step in script.deltas]  # the length a reply has

    def _gap_ms(self, seed: int, index: int) -> float:
        if index < len(self._plan):
            delay = self._plan[index].delay_ms
            if delay is not None:
                return delay
        return SimulatedEngine._gap_ms(self._engine, seed, index)

    def _token(self, index: int, count: int, made_at: float) -> Delta:
        self._engine._steps += 1
        finish = None
        if index == count - 1:
            finish = "length" if count < len(self._plan) else self.script.finish_reason
        step = self._plan[index]
        return Delta(step.text, 1, made_at, finish, tool_call=step.tool_call)


class ScriptedEngine(SimulatedEngine):
    """The simulated engine making a scripted reply (``engine.reply_script``): text and tool
    calls, each delta one token, on the script's own delays where it gives them.

    A subclass, so a plain simulated reply pays nothing per token for what scripts need.
    The script is replayed as written whatever tools a request offers: it stands in for a
    model to test clients, it is not one. Its calls are left out where the request's
    ``tool_choice`` forbids them (``"none"``: all; a named function: those to any other),
    and a ``tool_choice`` the script cannot honour (a call it does not make) is refused.
    """

    makes_tool_calls = True

    def __init__(self, config: SimulatedConfig, script: ReplyScript) -> None:
        super().__init__(config)
        self.script = script
        self._whole = ScriptedReply(self, script)
        self._words = self._whole._words  # the whole script's length, for ``schedule``
        # The script keeping only the calls to one function (None: no calls), by its name.
        self._kept = {
            name: ScriptedReply(self, script.keeping_calls_to(name))
            for name in (None, *script.call_names)
        }

    async def start(self, request: GenerationRequest) -> SimulatedStream:
        reply = self._reply_for(request.tool_choice)
        calls = reply.script.calls
        if request.parallel_tool_calls is False and calls > 1:
            raise RequestRejected(
                f"parallel tool calls are disabled, and this server's reply script makes "
                f"{calls} calls in one reply (it is replayed as written)",
                code="unsupported_parameter",
                param="parallel_tool_calls",
            )
        return self._open(request, reply)

    def _reply_for(self, choice: str | Mapping[str, object] | None) -> ScriptedReply:
        """The script as ``tool_choice`` (in chat's form) lets it be replayed, or refused
        when the script cannot honour the choice."""
        if choice == "none":
            reply = self._kept[None]
            if not reply.script.deltas:
                raise _cannot_honour(
                    'tool_choice "none" allows no tool calls, and this server\'s reply script '
                    "is only tool calls (it has no text to reply with)"
                )
            return reply
        if isinstance(choice, Mapping):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, Mapping) else None
            named = self._kept.get(name) if isinstance(name, str) else None
            if named is None:
                calls = ", ".join(repr(n) for n in self.script.call_names) or "none"
                raise _cannot_honour(
                    f"tool_choice names {name!r}, and this server's reply script makes no "
                    f"call to it (its calls: {calls}; it is replayed as written)"
                )
            return named
        if choice == "required" and not self.script.calls:
            raise _cannot_honour(
                'tool_choice "required" asks for a tool call, and this server\'s reply script '
                "makes none (it is replayed as written)"
            )
        return self._whole

    def _gap_ms(self, seed: int, index: int) -> float:
        return self._whole._gap_ms(seed, index)  # the whole script's, for ``schedule``


def _cannot_honour(message: str) -> RequestRejected:
    return RequestRejected(message, code="unsupported_parameter", param="tool_choice")


def simulated_engine(config: SimulatedConfig) -> SimulatedEngine:
    """The simulated engine ``config`` describes: scripted when it has a script."""
    if config.script is not None:
        return ScriptedEngine(config, config.script)
    return SimulatedEngine(config)


class SimulatedStream:
    """One simulated reply: iterate it (a timer per token), or attach a sink (shared ticks).

    Either way each token is due at a fixed time from ``start`` (the first token's queueing,
    then the sum of the delays up to it): late timers do not accumulate.
    """

    # Thousands are open at once: slots instead of an instance dict (about 240 bytes less).
    __slots__ = (
        "_count",
        "_due_ms",
        "_ended",
        "_engine",
        "_fail_at",
        "_next",
        "_reply",
        "_seed",
        "_sink",
        "_start",
        "_token",
    )

    def __init__(
        self,
        engine: SimulatedEngine,
        seed: int,
        count: int,
        first_ms: float,
        start: float,
        logprobs: int | None = None,
        *,
        first: int = 0,
        reply: TokenSource | None = None,
    ) -> None:
        self._engine = engine
        self._reply: TokenSource = engine if reply is None else reply  # what it makes
        self._seed = seed
        self._count = count  # the index the reply ends before
        self._start = start
        self._next = first  # the next token to deliver
        self._due_ms = first_ms + self._reply._gap_ms(seed, first)  # its due, from the start
        self._ended = False
        self._sink: DeltaSink | None = None
        self._fail_at = engine.config.fail_after
        # How token ``index`` is made: plain, or (only when asked) with its log probability.
        made = self._reply
        self._token: Callable[[int, int, float], Delta] = made._token
        if logprobs is not None:
            top = logprobs

            def with_logprob(index: int, count: int, made_at: float) -> Delta:
                lp = simulated_logprob(made._words, seed, index, top)
                return made._token(index, count, made_at)._replace(logprobs=(lp,))

            self._token = with_logprob

    def _next_due(self) -> float:
        """The loop time at which the next token is due."""
        return self._start + self._due_ms / 1000.0

    def _advance(self) -> None:
        self._next += 1
        self._due_ms += self._reply._gap_ms(self._seed, self._next)

    def _finish(self, outcome: str) -> None:
        if not self._ended:
            self._ended = True
            self._engine._ended(outcome)

    def _fails_now(self) -> bool:
        return self._fail_at == self._next

    def _failure(self) -> EngineError:
        return EngineError(f"simulated failure after {self._next} tokens")

    # Pull: the reader's task waits for each token.

    def __aiter__(self) -> SimulatedStream:
        return self

    async def __anext__(self) -> Delta:
        if self._ended:
            raise StopAsyncIteration
        if self._next >= self._count:  # nothing left to make (a continued reply was whole)
            self._finish("finished")
            raise StopAsyncIteration
        if self._fails_now():
            self._finish("failed")
            raise self._failure()
        loop = asyncio.get_running_loop()
        try:
            # Overdue tokens still yield to the loop, so a fast schedule cannot starve it.
            await asyncio.sleep(max(0.0, self._next_due() - loop.time()))
        except asyncio.CancelledError:
            self._finish("cancelled")  # a reader cancelled mid-wait never comes back
            raise
        if self._ended:
            raise StopAsyncIteration
        index = self._next
        self._advance()
        delta = self._token(index, self._count, time.monotonic())
        if self._next >= self._count:
            self._finish("finished")
        return delta

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self._sink is not None and self._engine._ticker is not None:
            self._engine._ticker.remove(self)
        self._finish("cancelled")

    # Push: one shared timer for every attached stream delivers due tokens to sinks.

    def attach(self, sink: DeltaSink) -> None:
        self._sink = sink
        ticker = self._engine._ticker
        assert ticker is not None
        if self._next < self._count:
            ticker.add(self, self._next_due())
        else:
            self._finish("finished")
            sink.on_end(None)

    def _fire(self, now: float, budget: int) -> float | None:
        """Deliver every token due by ``now`` (at most ``budget``, at least one) in one call
        to the sink; the next due time, or None once the stream ended."""
        sink = self._sink
        if self._ended or sink is None:
            return None
        first, count, fail_at = self._next, self._count, self._fail_at
        stop = min(count, first + max(1, budget))
        if fail_at is not None and first <= fail_at < stop:
            stop = fail_at  # the tokens before the failure, then the failure
        # Token ``first`` is due (the ticker fired for it); the ones after it, while due too.
        while self._next < stop:
            self._advance()
            if self._next_due() > now:
                break
        end = self._next
        if end > first:
            made_at = time.monotonic()
            token = self._token
            sink.on_deltas([token(index, count, made_at) for index in range(first, end)])
            if self._ended:  # the sink closed the stream while handling the tokens
                return None
        if fail_at == self._next:
            self._finish("failed")
            sink.on_end(self._failure())
            return None
        if self._next >= count:
            self._finish("finished")
            sink.on_end(None)
            return None
        return self._next_due()


# Tokens one tick may deliver before it lets the loop run sockets and other tasks: when the
# machine falls behind the schedule, overdue tokens would otherwise starve all I/O. A stream
# with several overdue tokens gets them in one call, so they leave in one socket write: the
# further behind the loop is, the less each event costs, and the schedule is caught up.
TOKENS_PER_TICK = 256


# uvloop's timers count whole milliseconds and can fire up to one early: a token due within
# that is delivered now, instead of re-arming for it and spinning the loop until its time.
TIMER_SLACK_S = 0.001


class _Ticker:
    """One timer for many streams: a heap of due times, fired in order by a single callback.

    Thousands of concurrent replies cost one timer wake-up per tick, not one per token each.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, SimulatedStream]] = []
        self._order = 0  # breaks ties between equal due times without comparing streams
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for = math.inf

    def add(self, stream: SimulatedStream, due: float) -> None:
        self._order += 1
        heapq.heappush(self._heap, (due, self._order, stream))
        if due < self._armed_for:
            self._arm(due)

    def remove(self, stream: SimulatedStream) -> None:
        """Forget a stream; its heap entry is dropped lazily when it comes due."""
        stream._sink = None

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = due
        self._timer = self._loop.call_at(due, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._armed_for = math.inf
        heap = self._heap
        now = self._loop.time() + TIMER_SLACK_S
        budget = TOKENS_PER_TICK
        while heap and heap[0][0] <= now and budget > 0:
            _, _, stream = heapq.heappop(heap)
            before = stream._next
            following = stream._fire(now, budget)
            budget -= max(1, stream._next - before)  # tokens delivered (a failure counts 1)
            if following is not None:
                self._order += 1
                heapq.heappush(heap, (following, self._order, stream))
        if heap:
            self._arm(heap[0][0])
