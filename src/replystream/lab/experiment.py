"""The stream-vs-wait experiment: the same generation, delivered buffered and streamed.

Fires ``calls`` requests at each mode, all at once, and compares when the first text and the
last text arrive. Call i of each mode uses seed ``seed + i``, so the two modes see identical
token schedules pair by pair and differ only in delivery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

from replystream.client import ReplyTiming, measure_reply
from replystream.client.transport import ConnectError, Connection, connect
from replystream.lab.ctrl_c import unless_interrupted
from replystream.stats import percentile

MODES = ("wait", "stream")


class WarmUpFailed(RuntimeError):
    """A mode's first, unmeasured call did not complete: nothing would be measured."""


class Interrupted(Exception):
    """Ctrl-C stopped the run before its calls were sent: nothing was measured."""


@dataclass(frozen=True, slots=True)
class LabConfig:
    """Parameters of one experiment (defaults match the reference lab).

    The schedule (``delay_ms``, ``jitter_ms``, ``first_token_ms``) is the local server's; with
    ``url`` the measured server keeps its own, so those are None there: a report never
    states a setting that was not applied. ``tokens`` is sent as each request's
    ``max_tokens``, so it holds for any server (None: the server's reply length).
    """

    tokens: int | None = 120
    delay_ms: float | None = 33.0
    jitter_ms: float | None = 8.0
    seed: int = 42
    first_token_ms: float | None = 0.0
    calls: int = 20
    url: str | None = None
    timeout_s: float = 300.0  # a call that has not ended by then is counted incomplete
    # Sent with every call (``--header``): a keyed server's key, say.
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        schedule = (self.delay_ms, self.jitter_ms, self.first_token_ms)
        if self.url is not None and schedule != (None, None, None):
            raise ValueError("a server at url keeps its own schedule: leave the schedule None")

    def server_args(self) -> list[str]:
        """Arguments for a local ``replystream serve`` that generates with this config."""
        if self.delay_ms is None or self.jitter_ms is None or self.first_token_ms is None:
            raise ValueError("a local server needs delay_ms, jitter_ms and first_token_ms")
        tokens = [] if self.tokens is None else ["--tokens", str(self.tokens)]
        return [
            "--engine",
            "simulated",
            *tokens,
            "--delay-ms",
            f"{self.delay_ms:g}",
            "--jitter-ms",
            f"{self.jitter_ms:g}",
            "--seed",
            str(self.seed),
            "--first-token-ms",
            f"{self.first_token_ms:g}",
        ]


@dataclass(frozen=True, slots=True)
class LabRun:
    """Every reply each mode received, in call order; ``interrupted``: Ctrl-C cut the calls
    still under way (each says so as its error)."""

    config: LabConfig
    timings: dict[str, list[ReplyTiming]]
    interrupted: bool = False

    def summary(self) -> dict[str, Any]:
        """The machine-readable result (the ``--json`` contract)."""
        result: dict[str, Any] = {}
        for mode in MODES:
            done = [t for t in self.timings[mode] if t.complete]
            first = [t.first_text_ms for t in done if t.first_text_ms is not None]
            total = [t.last_text_ms for t in done if t.last_text_ms is not None]
            headers = [t.headers_ms for t in done if t.headers_ms is not None]
            tokens = [float(t.tokens) for t in done]
            result[mode] = {
                "calls": len(self.timings[mode]),
                "complete": len(done),
                "first_text_ms": _median_p95(first),
                "total_ms": _median_p95(total),
                "headers_ms": _median_p95(headers),
                "body_bytes": _median_p95([float(t.body_bytes) for t in done]),
                "tokens": _median_p95(tokens),
                "errors": sorted({t.error for t in self.timings[mode] if t.error}),
            }
        # Call i of each mode asks for the same reply (seed + i), on the same schedule: the
        # modes are compared over the calls complete in both, pair by pair, not over
        # whichever calls of each happened to complete.
        pairs = [
            (wait, stream)
            for wait, stream in (
                (_times(w), _times(s))
                for w, s in zip(self.timings["wait"], self.timings["stream"], strict=True)
            )
            if wait is not None and stream is not None
        ]
        result["interrupted"] = self.interrupted
        result["compared_calls"] = len(pairs)
        both = bool(pairs)
        if both:
            wait_first = percentile([wait[0] for wait, _ in pairs], 50)
            stream_first = percentile([stream[0] for _, stream in pairs], 50)
            wait_total = percentile([wait[1] for wait, _ in pairs], 50)
            stream_total = percentile([stream[1] for _, stream in pairs], 50)
        result["first_text_sooner_ms"] = round(wait_first - stream_first, 3) if both else None
        result["total_median_diff_ms"] = round(stream_total - wait_total, 3) if both else None
        result["total_median_diff_pct"] = (
            round(100.0 * (stream_total - wait_total) / wait_total, 3)
            if both and wait_total
            else None
        )
        config = asdict(self.config)
        # Their names alone: a header's value may be a key, which a result file must not keep.
        config["headers"] = [name for name, _ in self.config.headers]
        result["config"] = config
        return result

    def timeline(self) -> dict[str, Any]:
        """Word-by-word arrival times of one call of each mode (``timeline.json``): the first
        pair complete in both modes (call i of each asks for the same reply), else call 0."""
        pairs = zip(self.timings["wait"], self.timings["stream"], strict=True)
        index = next(
            (
                i
                for i, (w, s) in enumerate(pairs)
                if _times(w) is not None and _times(s) is not None
            ),
            0,
        )
        out: dict[str, Any] = {}
        for mode in MODES:
            timing = self.timings[mode][index]
            arrivals = []
            offset = 0
            for at, chars in zip(timing.text_event_ms, timing.text_event_chars, strict=True):
                arrivals.append(
                    {"t_ms": round(at, 3), "text": timing.text[offset : offset + chars]}
                )
                offset += chars
            out[mode] = {
                "call": index,
                "seed": self.config.seed + index,
                "complete": timing.complete,
                "error": timing.error,
                "headers_ms": timing.headers_ms,
                "first_text_ms": timing.first_text_ms,
                "total_ms": timing.last_text_ms,
                "arrivals": arrivals,
            }
        return out


async def _connect(url: str, timeout_s: float) -> Connection:
    """A connection to ``url``'s server, made within ``timeout_s``.

    Raises:
        ConnectError: none was made; a host that drops the handshake (a full accept queue, a
            firewall) is waited for as long as a call, not for the kernel's retries.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await connect(url)
    except TimeoutError:
        where = urlsplit(url).netloc
        message = f"cannot connect to {where}: no connection within {timeout_s:g} s"
        raise ConnectError(message, refused=False) from None


def _times(timing: ReplyTiming) -> tuple[float, float] | None:
    """A complete call's first and last text's times (None: incomplete, or no text)."""
    first, last = timing.first_text_ms, timing.last_text_ms
    return (first, last) if timing.complete and first is not None and last is not None else None


def _median_p95(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p95": None}
    return {"median": round(percentile(values, 50), 3), "p95": round(percentile(values, 95), 3)}


async def run_experiment(
    config: LabConfig,
    url: str,
    on_done: Callable[[str, ReplyTiming], None] | None = None,
    interrupt: asyncio.Event | None = None,
) -> LabRun:
    """Fire every call of both modes at once against ``url`` and collect their timings.

    ``interrupt``: once set (a user's Ctrl-C), the calls still under way are cut and counted
    incomplete, and the run returns what ended before, marked ``interrupted``.

    Raises:
        Interrupted: ``interrupt`` was set before the calls were sent.
    """

    async def one(mode: str, index: int, connection: Connection) -> ReplyTiming:
        params = {"seed": config.seed + index}
        if config.tokens is not None:
            params["max_tokens"] = config.tokens
        query = urlencode(params)
        call_url = f"{url}/{mode}?{query}"
        try:
            timing = await measure_reply(
                call_url,
                headers=config.headers,
                connection=connection,
                timeout_s=config.timeout_s,
            )
        except asyncio.CancelledError:
            if interrupt is None or not interrupt.is_set():
                raise
            timing = _cut(call_url, mode)
        if on_done is not None:
            on_done(mode, timing)
        return timing

    async def warm_up() -> None:
        # One short call per mode first, so one-time costs (code paths run for the first
        # time) are not charged to the measured calls. One that fails says the calls would
        # fail too (no such route, a server that does not answer): the run stops there,
        # saying why. Its connection is made as the calls' are, so a server not there is
        # said as for them.
        for mode in MODES:
            warm_up = f"{url}/{mode}?max_tokens=1"
            warm = await _connect(url, config.timeout_s)
            timing = await measure_reply(
                warm_up, headers=config.headers, connection=warm, timeout_s=config.timeout_s
            )
            if not timing.complete:
                raise WarmUpFailed(f"the warm-up call GET {warm_up} failed: {timing.error}")

    # Connections are opened first, as a client with warm connections has them, so "all at
    # once" means all requests written in one burst and connection setup is not timed.
    connections: dict[str, list[Connection]] = {mode: [] for mode in MODES}

    async def connect_all() -> None:
        for mode in MODES:
            for _ in range(config.calls):
                connections[mode].append(await _connect(url, config.timeout_s))

    tasks: dict[str, list[asyncio.Task[ReplyTiming]]] = {}

    async def calls() -> None:
        async with asyncio.TaskGroup() as group:
            for mode in MODES:
                tasks[mode] = [
                    group.create_task(one(mode, i, c)) for i, c in enumerate(connections[mode])
                ]

    try:
        cut = await unless_interrupted(interrupt, warm_up()) or await unless_interrupted(
            interrupt, connect_all()
        )
        interrupted = cut or await unless_interrupted(interrupt, calls())
        if len(tasks) < len(MODES):  # cut before the calls were made
            raise Interrupted(
                "interrupted (Ctrl-C) before the calls were sent: nothing was measured"
            )
    finally:
        # Each call closes its own; these are the ones a failure left unused (a connect that
        # failed part way, calls cancelled before they began).
        for opened in connections.values():
            for connection in opened:
                connection.close()
    timings = {mode: [_ended(t, mode, url) for t in tasks[mode]] for mode in MODES}
    return LabRun(config, timings, interrupted=interrupted)


INTERRUPTED = "interrupted (Ctrl-C) before it ended"


def _cut(url: str, mode: str) -> ReplyTiming:
    """A call the user's Ctrl-C cut before it ended: incomplete, and saying why."""
    return ReplyTiming(
        url=url,
        streamed=mode == "stream",
        complete=False,
        error=INTERRUPTED,
        status=None,
        headers_ms=None,
        first_chunk_ms=None,
        first_text_ms=None,
        last_text_ms=None,
        closed_ms=0.0,
        body_bytes=0,
        text="",
        tokens=0,
    )


def _ended(task: asyncio.Task[ReplyTiming], mode: str, url: str) -> ReplyTiming:
    # A call cancelled before its first step (the interrupt came as the calls were made)
    # never reached its own handler of the cut.
    return _cut(f"{url}/{mode}", mode) if task.cancelled() else task.result()
