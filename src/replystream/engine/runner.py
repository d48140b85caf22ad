"""The step loop: scheduler, then model, then sampler, in a worker thread off the event loop.

This file decides how requests cross between asyncio and the worker thread, and what is
recorded about each request's time:
1. ``submit`` and ``abort`` may be called from any thread; they only append to pending lists.
   The worker applies them at the start of its next step, so the scheduler, the KV cache and
   every request's sampler are touched by the worker alone.
2. Each delta (or an ``EngineError``) goes to the request's ``asyncio.Queue`` through
   ``loop.call_soon_threadsafe``; the model never waits for a reader. A request the scheduler
   takes up for the first time (its first chunk runs in this step) is told so the same way
   (``submit``'s ``admitted``), before that step's delta.
3. BLAS runs on ``blas_threads`` threads (1 by default) while the worker runs.
   A chunk with a speculative draft is verified here (``speculative.accept``), and every token
   one step makes for a request goes out as one delta (``Delta.tokens`` says how many).
4. Timestamps (queued, first scheduled, each token, each preemption, finished) are taken
   with the injected clock and read back as frozen ``RequestTimings``.
The lock guards the pending lists, the scheduler and the counters; the model runs outside it.
It must not know about HTTP or about how a reply is delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from replystream.engine.base import Delta, EngineError, EngineStats, SamplingParams, TokenLogprob
from replystream.engine.kv_cache import PagedKVCache
from replystream.engine.model import Chunk, TinyModel
from replystream.engine.sampling import (
    StopMatcher,
    TokenHistory,
    ends_held,
    penalize,
    penalizes,
    sample_token,
    token_logprob,
    without_ends,
)
from replystream.engine.scheduler import Batch, Scheduler, SchedulerStats
from replystream.engine.seeds import generator_seed
from replystream.engine.speculative import accept
from replystream.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer

log = logging.getLogger("replystream.engine")

DeltaQueue = asyncio.Queue[Delta | EngineError]
TIMINGS_KEPT = 4096  # timings of ended requests kept for readers, oldest dropped first


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """When things happened to one request (clock seconds; ``None`` if not yet)."""

    queued: float
    scheduled: float | None
    first_token: float | None
    tokens: tuple[float, ...]
    preempted: tuple[float, ...]
    finished: float | None
    finish_reason: str | None


@dataclass(slots=True, eq=False)
class _Request:
    request_id: int
    prompt: list[int]
    max_new: int
    params: SamplingParams
    deliver: Callable[[Delta | EngineError], None]
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    rng: np.random.Generator
    queued: float
    scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    preempted: list[float] = field(default_factory=list)
    finished: float | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens not yet delivered
    history: TokenHistory | None = None  # what the penalties look at (None: none asked)
    # Of the prompt's tokens, those found in the prefix cache when it was last admitted
    # before its first token (None: the cache keeps no prefixes).
    cached: int | None = None
    picked: int = 0  # tokens picked for it so far (every pick is a token made)
    # Called (on the worker) when its first chunk is scheduled: it leaves the queue.
    admitted: Callable[[], None] | None = None


class Runner:
    """Owns a scheduler, a KV cache and a model; runs steps in a worker thread."""

    def __init__(
        self,
        model: TinyModel,
        tokenizer: ByteTokenizer,
        cache: PagedKVCache,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.monotonic,
        blas_threads: int | None = 1,
        stop_tokens: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.stop_tokens = stop_tokens  # end-of-generation ids (EOS): never shown, end as "stop"
        self.tokenizer = tokenizer
        self.cache = cache
        self.scheduler = scheduler
        self.clock = clock
        self.blas_threads = blas_threads
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._aborts: list[int] = []
        self._requests: dict[int, _Request] = {}
        self._timings: OrderedDict[int, RequestTimings] = OrderedDict()  # ended, newest last
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counts = {"started": 0, "finished": 0, "cancelled": 0, "failed": 0}
        self._steps = 0

    def submit(
        self,
        prompt: list[int],
        max_new: int,
        params: SamplingParams,
        admitted: Callable[[], None] | None = None,
    ) -> tuple[int, DeltaQueue]:
        """Queue a request (call on the event loop); its deltas arrive on the returned queue,
        and ``admitted`` is called on the loop when the scheduler first takes it up."""
        loop = asyncio.get_running_loop()
        queue: DeltaQueue = asyncio.Queue()

        def deliver(item: Delta | EngineError) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed: nobody is reading any more
                pass

        def admit() -> None:
            assert admitted is not None
            try:
                loop.call_soon_threadsafe(admitted)
            except RuntimeError:
                pass

        told = None if admitted is None else admit
        return self.submit_with(prompt, max_new, params, deliver, told), queue

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the worker from taking submissions until the block ends, so that those made
        in it are admitted together, at one step (a burst, as the lab's experiments send
        one). On the event loop's thread; nothing in the block may wait for the worker."""
        with self._cond:  # a re-entrant lock: ``submit_with`` takes it again inside
            yield

    def submit_with(
        self,
        prompt: list[int],
        max_new: int,
        params: SamplingParams,
        deliver: Callable[[Delta | EngineError], None],
        admitted: Callable[[], None] | None = None,
    ) -> int:
        """Queue a request whose deltas go to ``deliver`` (called on the worker thread), and
        ``admitted`` (on the worker too) when its first chunk is scheduled.

        ``params.seed`` seeds the request's generator, which it keeps through preemptions
        (a recompute makes no draw); None: fresh entropy (an engine settles the seed first).

        Raises:
            EngineError: the runner was stopped.
        """
        with self._cond:
            if self._stopping:
                raise EngineError("the engine was closed", code="engine_closed")
            request_id = self._next_id
            self._next_id += 1
            self._pending.append(
                _Request(
                    request_id=request_id,
                    prompt=prompt,
                    max_new=max_new,
                    params=params,
                    deliver=deliver,
                    detokenizer=IncrementalDetokenizer(self.tokenizer),
                    stop=StopMatcher(params.stop),
                    rng=np.random.default_rng(generator_seed(params.seed)),
                    queued=self.clock(),
                    history=TokenHistory(prompt) if penalizes(params) else None,
                    admitted=admitted,
                )
            )
            self._counts["started"] += 1
            self._cond.notify()
        return request_id

    def abort(self, request_id: int) -> None:
        """Cancel a request; the worker drops it and frees its blocks at its next step."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def step(self) -> Batch:
        """Apply pending submissions and aborts, then run one scheduled step."""
        with self._cond:
            self._apply_pending()
            batch = self.scheduler.schedule()
            now = self.clock()
            for seq_id in batch.preempted:
                self._requests[seq_id].preempted.append(now)
            if self.scheduler.allocator.caches_prefixes:
                for seq_id, cached in batch.admitted:
                    admitted = self._requests[seq_id]
                    if not admitted.token_times:  # (a readmission mid-reply counts no prompt)
                        admitted.cached = cached
            requests = {c.seq_id: self._requests[c.seq_id] for c in batch.chunks}
            for request in requests.values():
                if request.scheduled is None:  # taken up for the first time: out of the queue
                    request.scheduled = now
                    if request.admitted is not None:
                        request.admitted()
        if not batch.chunks:
            return batch
        rows = [1 + c.draft for c in batch.chunks]  # a draft is verified at every position
        logits = self.model.forward(
            [Chunk(c.seq_id, c.tokens, c.start) for c in batch.chunks], self.cache, rows
        )  # (sum(rows), vocab)
        sampled: dict[int, list[int]] = {}
        first = 0
        for c, n in zip(batch.chunks, rows, strict=True):
            if c.samples:
                request = requests[c.seq_id]

                def pick(row: NDArray[np.float32], r: _Request = request) -> int:
                    z = row if r.history is None else penalize(row, r.params, r.history)
                    if ends_held(r.params, r.picked):
                        z = without_ends(z, self.stop_tokens)
                    token = sample_token(z, r.params, r.rng)
                    r.picked += 1
                    if r.history is not None:  # each pick sees the tokens picked before it
                        r.history.add(token)
                    # Log probabilities are the model's own (``token_logprob``), unpenalized.
                    if r.params.logprobs is not None:  # every pick is a made token
                        top, to_bytes = r.params.logprobs, self.tokenizer.spelt_bytes
                        hidden = self.tokenizer.hidden_ids
                        r.logprobs.append(token_logprob(row, token, top, to_bytes, hidden))
                    return token

                sampled[c.seq_id] = accept(
                    list(logits[first : first + n]), c.tokens[len(c.tokens) - c.draft :], pick
                )
            first += n
        with self._cond:
            self._steps += 1
            ended = {f.seq_id for f in self.scheduler.record(batch, sampled)}
            now = self.clock()
            for seq_id, tokens in sampled.items():
                if seq_id in self._requests:  # not cancelled by stop() during the step
                    self._emit(self._requests[seq_id], tokens, seq_id in ended, now)
        return batch

    def _emit(self, request: _Request, tokens: list[int], at_length: bool, now: float) -> None:
        if request.params.logprobs is not None and len(tokens) > 1:
            # A step that accepted a draft made several tokens. With log probabilities each
            # goes out as its own delta, as plain decoding makes them: the reply pipeline
            # gives a delta's entries to the text it carries, and a stop string beginning
            # among them must not take the text's tokens with it (nor give it its own).
            last = len(tokens) - 1
            for index, token in enumerate(tokens):
                if self._emit_tokens(request, [token], at_length and index == last, now):
                    return
            return
        self._emit_tokens(request, tokens, at_length, now)

    def _emit_tokens(
        self, request: _Request, tokens: list[int], at_length: bool, now: float
    ) -> bool:
        """Deliver one delta of ``tokens``; True when it ended the reply."""
        # The first delta says how many tokens the model read: the prompt a chat template
        # made, which the server cannot count from the conversation's text.
        first = not request.token_times
        prompt_tokens = len(request.prompt) if first else None
        cached = request.cached if first else None
        text = ""
        count = 0
        eos = False
        for token in tokens:  # several with speculative decoding; a stop cuts the rest
            request.token_times.append(now)
            count += 1
            if token in self.stop_tokens:
                eos = True
                break
            text += request.stop.feed(request.detokenizer.push(token))
            if request.stop.stopped:
                break
        if eos or (at_length and not request.stop.stopped):  # the reply ends: nothing held back
            text += request.stop.feed(request.detokenizer.flush())
            if not request.stop.stopped:
                text += request.stop.flush()
        reason = "stop" if request.stop.stopped or eos else "length" if at_length else None
        if reason == "stop" and not at_length:
            self.scheduler.finish(request.request_id)
        logprobs = None
        if request.params.logprobs is not None:  # those of the tokens shown, in order
            logprobs = tuple(request.logprobs[: count - eos])  # an EOS token is never shown
            if reason is None:
                del request.logprobs[:count]  # the step's later tokens' are theirs
            else:
                request.logprobs.clear()
        request.deliver(
            Delta(
                text,
                count,
                now,
                reason,
                logprobs=logprobs,
                prompt_tokens=prompt_tokens,
                cached_prompt_tokens=cached,
            )
        )
        if reason is not None:
            request.finished, request.finish_reason = now, reason
            self._counts["finished"] += 1
            self._retire(request)
            return True
        return False

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for request in pending:
            self._requests[request.request_id] = request
            try:
                self.scheduler.add(request.request_id, request.prompt, request.max_new)
            except ValueError as error:  # the engine checks first; this is the last guard
                self._fail(request, EngineError(str(error)))
        for request_id in self._aborts:
            live = self._requests.get(request_id)
            if live is not None and self.scheduler.abort(request_id):
                self._cancel(live)
        self._aborts.clear()

    def _cancel(self, request: _Request, error: EngineError | None = None) -> None:
        request.finished, request.finish_reason = self.clock(), "cancelled"
        self._counts["cancelled"] += 1
        if error is not None:
            request.deliver(error)
        self._retire(request)

    def _retire(self, request: _Request) -> None:
        self._timings[request.request_id] = self._snapshot(request)
        while len(self._timings) > TIMINGS_KEPT:
            self._timings.popitem(last=False)
        del self._requests[request.request_id]

    @staticmethod
    def _snapshot(r: _Request) -> RequestTimings:
        return RequestTimings(
            queued=r.queued,
            scheduled=r.scheduled,
            first_token=r.token_times[0] if r.token_times else None,
            tokens=tuple(r.token_times),
            preempted=tuple(r.preempted),
            finished=r.finished,
            finish_reason=r.finish_reason,
        )

    def timings(self, request_id: int) -> RequestTimings | None:
        """A request's timestamps so far (kept after it ends, for the last 4,096 that ended)."""
        with self._cond:
            live = self._requests.get(request_id)
            if live is not None:
                return self._snapshot(live)
            for pending in self._pending:
                if pending.request_id == request_id:
                    return self._snapshot(pending)
            return self._timings.get(request_id)

    def _fail_all(self, error: Exception) -> None:
        # A bug of ours or the machine's (out of memory): the traceback is for the log; a
        # client is told the step failed, never an exception's text.
        log.error("a decode step failed; every request in the engine ends", exc_info=error)
        failure = EngineError("the model failed while generating (the server log says why)")
        with self._cond:
            self._apply_pending()
            for request in list(self._requests.values()):
                self.scheduler.abort(request.request_id)
                self._fail(request, failure)

    def _fail(self, request: _Request, error: EngineError) -> None:
        request.finished, request.finish_reason = self.clock(), "failed"
        request.deliver(error)
        self._counts["failed"] += 1
        self._retire(request)

    def _idle(self) -> bool:
        return not (self._pending or self._aborts or self.scheduler.has_work())

    def _loop(self) -> None:
        # BLAS threads for the whole process (OpenBLAS has one setting): at these matrix sizes
        # a second thread costs more than it gains, and the event loop needs the other core.
        with threadpool_limits(limits=self.blas_threads, user_api="blas"):
            self._steps_until_stopped()

    def _steps_until_stopped(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self._idle():
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # a failed step ends every request it touched
                self._fail_all(error)

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tiny-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the worker thread (after the step it is in), then cancel every request.

        The cancelling waits for the worker to have ended: a step runs the model outside the
        lock, and aborting its requests under it would free KV blocks the step still writes
        (rule 1: while the worker lives, it alone touches the scheduler)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._cond:
            self._apply_pending()
            closed = EngineError("the engine was closed", code="engine_closed")
            for request in list(self._requests.values()):
                self.scheduler.abort(request.request_id)
                self._cancel(request, closed)

    def stats(self) -> EngineStats:
        with self._cond:
            scheduler = self.scheduler.stats()
            return EngineStats(
                started=self._counts["started"],
                finished=self._counts["finished"],
                cancelled=self._counts["cancelled"],
                failed=self._counts["failed"],
                active=len(self._requests) + len(self._pending),
                steps=self._steps,
                kv_blocks_used=scheduler.kv.used_blocks,
                kv_blocks_total=scheduler.kv.total_blocks,
                running=scheduler.running,
                preemptions=scheduler.preemptions,
                recomputed_tokens=scheduler.recomputed,
                kv_blocks_cached=scheduler.kv.cached_blocks,
                prefix_hit_tokens=scheduler.prefix_hit_tokens,
            )

    def scheduler_stats(self) -> SchedulerStats:
        with self._cond:
            return self.scheduler.stats()
