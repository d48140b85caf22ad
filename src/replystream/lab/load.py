"""Drive an endpoint with one profile's closed or open loop and keep every reply's timing.

This file issues the requests a ``Profile`` paces: a closed loop keeps ``in_flight`` requests
in flight (a finished request starts the next); an open loop issues requests at the profile's
arrival times whatever is still in flight, so a slow server meets a growing queue as it would
in production. ``requests`` or ``duration_s`` bounds how many are issued; every issued request
is awaited. A run whose first request to end (the warm-up's, when there is one) could not
connect, before any other did, stops issuing there: a server that is not there would otherwise
meet a closed loop that fails as fast as it can for the whole duration, and the run could
measure nothing but the refusal. It also measures the load client's own CPU use (process
CPU time over wall time), so a saturated client is visible. It must not know what the timings
mean (``benchstats``) or how they are shown; the run's config and records are ``load_types``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import time
from collections.abc import Callable

from replystream.client import Backoff, measure_reply
from replystream.client.transport import Headers
from replystream.lab.ctrl_c import unless_interrupted
from replystream.lab.drop_resume import ResumeOutcome, drop_and_resume
from replystream.lab.load_types import LoadConfig, LoadRun, RequestRecord
from replystream.lab.server_metrics import Scrape, ScrapeError, scrape, scrape_when_idle
from replystream.lab.workload import build_request, plan, system_prompt_of

# How a closed loop's reader waits after a request that could not connect: up to 10 ms at
# first, doubling to at most 1 s, so a server that went away mid-run meets a few attempts a
# second per reader rather than thousands.
RECONNECT = Backoff(base_s=0.01, cap_s=1.0)


class _Issuer:
    """Hands out request indexes until the count or the duration is used up."""

    def __init__(self, config: LoadConfig, started: float) -> None:
        self._config = config
        self._started = started
        self._next = 0
        self._stopped = False

    def stop(self) -> None:
        """Hand out no more indexes."""
        self._stopped = True

    def time_left(self) -> float:
        """Seconds until the duration ends (infinite without one)."""
        if self._config.duration_s is None:
            return float("inf")
        return max(0.0, self._started + self._config.duration_s - time.perf_counter())

    def take(self, at: float | None = None) -> int | None:
        config = self._config
        if self._stopped:
            return None
        if config.requests is not None and self._next >= config.requests:
            return None
        elapsed = (time.perf_counter() if at is None else at) - self._started
        if config.duration_s is not None and elapsed >= config.duration_s:
            return None
        index = self._next
        self._next += 1
        return index


async def run_load(
    config: LoadConfig,
    on_done: Callable[[RequestRecord], None] | None = None,
    *,
    interrupt: asyncio.Event | None = None,
) -> LoadRun:
    """Run the load described by ``config`` and return every request's record (none, and
    ``unreachable`` set, when the warm-up could not connect).

    ``interrupt``: once set (a user's Ctrl-C), no request is sent and those in flight are
    cancelled; the run returns what ended before, marked ``interrupted``.
    """
    reachability = _Reachability()
    if config.warmup:
        # One request first, not recorded, so one-time costs (first code paths, connection
        # pools behind the URL) are not charged to the measured requests.
        warmup = _conversation(config, -1, 0.0, reachability.saw, turns=1)
        if await unless_interrupted(interrupt, warmup):
            return LoadRun(config, (), 0.0, 0.0, interrupted=True)
        if reachability.refusal is not None:
            return LoadRun(config, (), 0.0, 0.0, unreachable=reachability.refusal)
    records: list[RequestRecord] = []
    # Requests sent and not yet ended, by index: their send times (from the run's start).
    # Those left when Ctrl-C cancels the run were sent, though they end in no record.
    in_flight: dict[int, float] = {}
    before: Scrape | None = None
    error: str | None = None
    if config.server_metrics is not None:
        try:
            before = await scrape(config.server_metrics, config.headers, tls=config.tls)
        except ScrapeError as exc:
            error = str(exc)
    cpu_start = time.process_time()
    started = time.perf_counter()
    issuer = _Issuer(config, started)

    def done(record: RequestRecord) -> None:
        in_flight.pop(record.index, None)
        records.append(record)
        reachability.saw(record)
        if reachability.refusal is not None:
            issuer.stop()
        if on_done is not None:
            on_done(record)

    async def send(index: int, scheduled_s: float | None = None) -> bool:
        return await _conversation(
            config,
            index,
            started,
            done,
            turns=config.turns,
            in_flight=in_flight,
            scheduled_s=scheduled_s,
        )

    rng = random.Random(f"{config.seed}:reconnect")

    async def issue() -> None:
        async with asyncio.TaskGroup() as group:
            in_flight = config.profile.in_flight
            if in_flight is not None:
                # No more readers than conversations (the rest would find none): a closed
                # loop of 10**8 for 2 requests made 10**8 tasks before the first read.
                if config.requests is not None:
                    in_flight = min(in_flight, config.requests)

                async def worker() -> None:
                    # A reader starts with the run: its first conversation counts as
                    # sent at the start, so a duration shorter than readers take to
                    # start (1e-300 s) still measures something, as an open loop's first
                    # arrival at 0 does.
                    at: float | None = started
                    refused = 0  # requests in a row that could not connect
                    while (index := issuer.take(at)) is not None:
                        at = None
                        refused = 0 if await send(index) else refused + 1
                        if refused:
                            # A server gone mid-run refuses at once: the reader retries as a
                            # client would, backing off, not as fast as refusals come back.
                            wait = RECONNECT.delay(refused - 1, None, rng)
                            await asyncio.sleep(min(wait, issuer.time_left()))

                for _ in range(in_flight):
                    group.create_task(worker())
            else:
                for offset in config.profile.arrivals(config.seed):
                    index = issuer.take(started + offset)
                    if index is None:
                        break
                    delay = started + offset - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    group.create_task(send(index, offset))

    samples: list[tuple[float, Scrape]] = []
    async with asyncio.TaskGroup() as outer:
        sampler: asyncio.Task[None] | None = None
        if config.server_metrics is not None and config.metrics_interval_s is not None:
            sampler = outer.create_task(
                _sample(
                    config.server_metrics,
                    config.headers,
                    config.tls,
                    config.metrics_interval_s,
                    started,
                    samples,
                )
            )
        try:
            interrupted = await unless_interrupted(interrupt, issue())
        finally:
            # The run is over when its last reply ended: a scrape still waiting on a slow
            # /metrics then is no part of its wall time (which throughput divides by), and
            # is dropped rather than awaited (the scrape after the run is the one to wait).
            wall = time.perf_counter() - started
            cpu = time.process_time() - cpu_start
            if sampler is not None:
                sampler.cancel()
    records.sort(key=lambda r: r.index)
    after: Scrape | None = None
    if config.server_metrics is not None and before is not None:
        try:
            after = await scrape_when_idle(config.server_metrics, config.headers, tls=config.tls)
        except ScrapeError as exc:
            error = str(exc)
    return LoadRun(
        config,
        tuple(records),
        wall,
        cpu,
        before,
        after,
        error,
        tuple(samples),
        reachability.refusal,
        interrupted,
        tuple(sorted(in_flight.values())),
    )


class _Reachability:
    """Whether the server was ever reached; the refusal, when the first request to end
    could not connect before any other did."""

    def __init__(self) -> None:
        self.reached = False
        self.refusal: str | None = None

    def saw(self, record: RequestRecord) -> None:
        """Note how ``record``'s request ended."""
        if record.timing.connected:
            self.reached = True
        elif not self.reached and self.refusal is None:
            self.refusal = record.timing.error or "cannot connect"


async def _sample(
    url: str,
    headers: Headers,
    tls: ssl.SSLContext | None,
    interval_s: float,
    started: float,
    samples: list[tuple[float, Scrape]],
) -> None:
    """Scrape ``url`` every ``interval_s`` until cancelled; a failed scrape is skipped (the
    before and after scrapes say whether the metrics can be read at all)."""
    while True:
        with contextlib.suppress(ScrapeError):
            samples.append((time.perf_counter() - started, await scrape(url, headers, tls=tls)))
        await asyncio.sleep(interval_s)


async def _conversation(
    config: LoadConfig,
    number: int,
    started: float,
    done: Callable[[RequestRecord], None],
    *,
    turns: int,
    in_flight: dict[int, float] | None = None,
    scheduled_s: float | None = None,
) -> bool:
    """Send conversation ``number``'s turns one after another, each resending the turns
    before it with the replies received; a turn that did not complete ends it (a chat
    client would have nothing to resend). False when its last request could not connect.
    ``in_flight``: each request's send time is put there under its index until ``done``.
    ``scheduled_s``: when an open loop meant to send the first turn (from the run's start)."""
    # Lengths are drawn per conversation, so its shape does not depend on completion order.
    rng = random.Random(f"{config.seed}:{number}")
    planned = plan(
        max(number, 0),
        rng,
        prompt_words=config.prompt_words,
        output_tokens=config.output_tokens,
        prompts=config.prompts,
        in_order=config.prompts_in_order,
        turns=turns,
    )
    system = system_prompt_of(config.system_words)
    # Drawn apart from the lengths, so adding cancels or drops does not change what is asked.
    draw = random.Random(f"{config.seed}:{number}:cut").random() if number >= 0 else 1.0
    cancels = draw < config.cancel_share
    drops = not cancels and draw < config.cancel_share + config.drop_share
    history: list[tuple[str, str]] = []
    for turn, one in enumerate(planned):
        spec = build_request(
            config.api,
            config.url,
            prompt=one.prompt,
            max_tokens=one.max_tokens,
            model=config.model,
            system=system,
            history=history,
            ignore_eos=config.ignore_eos,
        )
        sent = time.perf_counter()
        index = number * config.turns + turn
        if in_flight is not None:
            in_flight[index] = sent - started
        resume: ResumeOutcome | None = None
        if drops and turn == 0 and spec.json_body is not None:
            timing, resume = await drop_and_resume(
                spec.url,
                spec.json_body,
                config.drop_after,
                config.timeout_s,
                config.headers,
                route="responses" if config.api == "responses" else "native",
                cursor=config.resume_cursor,
                tls=config.tls,
            )
        else:
            timing = await measure_reply(
                spec.url,
                method=spec.method,
                json_body=spec.json_body,
                headers=config.headers,
                timeout_s=config.timeout_s,
                stop_after_tokens=config.cancel_after if cancels and turn == 0 else None,
                tls=config.tls,
            )
        # The whole prompt sent: the shared system prompt and the history resent too.
        words = config.system_words + one.words
        words += sum(len(text.split()) for pair in history for text in pair)
        scheduled = scheduled_s if turn == 0 else None
        done(
            RequestRecord(
                index, sent - started, words, one.max_tokens, timing, turn, resume, scheduled
            )
        )
        if not timing.complete:
            return timing.connected
        history.append((one.prompt, timing.text))
    return True
