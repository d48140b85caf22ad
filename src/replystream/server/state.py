"""Gauges of what the server process holds right now, read when ``/metrics`` is scraped.

A long run that leaks shows here first: asyncio tasks and file descriptors that outlive their
replies, KV blocks nobody frees, reply logs nobody drops. Each gauge is computed on scrape
from the owner's own ``stats()`` (or the interpreter's), so nothing is touched per event.
This file must not know how tokens are made: an engine's KV pool is read from its
``stats()``, when it has one (``kv_blocks_used``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from replystream.delivery.replay import ReplayStore
from replystream.engine.base import ATTEMPT_RESULTS, BackendStats, Engine, EngineStats
from replystream.server import log_sink
from replystream.server.context import (
    ENGINE_KEY,
    LOCAL_STORE_KEY,
    MANAGER_KEY,
    METRICS_KEY,
    STORE_KEY,
)
from replystream.server.metrics import STATE_REFRESH_S, AcrossWorkers, Metrics
from replystream.stats import LATENCY_BOUNDS

_FD_DIR = "/proc/self/fd"
# A relay's per-upstream rows, which follow its routes when they are read again.
BACKEND_GAUGES_KEY: web.AppKey[BackendGauges] = web.AppKey("backend_gauges")


def open_tasks() -> float:
    """asyncio tasks not yet done in this thread's running loop (0 outside a loop)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


def open_fds() -> float:
    """File descriptors open in this process (NaN where ``/proc`` does not list them)."""
    try:
        # The directory listing holds one descriptor of its own while it runs.
        return len(os.listdir(_FD_DIR)) - 1
    except OSError:
        return float("nan")


def add_state_gauges(app: web.Application) -> None:
    """Register the process-state gauges of ``app`` on its metrics registry."""
    metrics = app[METRICS_KEY]
    engine = app[ENGINE_KEY]
    manager = app[MANAGER_KEY]
    metrics.state("replystream_open_tasks", "asyncio tasks alive in this process.", open_tasks)
    metrics.state("replystream_open_fds", "File descriptors open in this process.", open_fds)
    metrics.state(
        "replystream_log_lines_dropped",
        "Log lines dropped because stderr was not read as fast as they came, since start.",
        lambda: log_sink.dropped_lines(),
        across="sum",
    )
    metrics.state(
        "replystream_replies_in_flight",
        "Replies being produced or collected (streamed and buffered).",
        lambda: len(manager),
    )
    metrics.state(
        "replystream_open_readers",
        "Connections following a reply log.",
        lambda: len(manager.readers),
    )
    metrics.state(
        "replystream_engine_requests",
        "Requests the engine holds, queued or running.",
        lambda: engine.stats().active,
    )
    if engine.stats().kv_blocks_used is not None:  # an engine with a paged KV cache
        _add_batch_gauges(metrics, engine)
    gauges = add_backend_gauges(metrics, engine)
    if gauges is not None:
        app[BACKEND_GAUGES_KEY] = gauges
    local = app[LOCAL_STORE_KEY]
    stores: list[tuple[str, ReplayStore]] = [("local", local)]
    if app[STORE_KEY] is not local:  # else one store serves both
        stores.append(("resumable", app[STORE_KEY]))
    for label, store in stores:
        metrics.state(
            "replystream_reply_logs",
            "Reply logs kept (live, or ended and not yet expired or dropped).",
            _log_count(store),
            store=label,
        )
    _log_faults(metrics, stores)
    if metrics.has_readings:
        app.cleanup_ctx.append(_publishing_readings)


# Gauges read from ``Engine.stats()`` fields: (name, help, field, how workers' readings add up).
EngineGauge = tuple[str, str, str, AcrossWorkers]

# An engine that batches over a paged KV cache: its pool, its batch and its queue, what making
# room cost (a pool too small for the load preempts, and recomputes), and what its prefix
# cache saved.
_BATCH_GAUGES: tuple[EngineGauge, ...] = (
    (
        "replystream_kv_blocks_used",
        "KV cache blocks held by requests.",
        "kv_blocks_used",
        "livesum",
    ),
    ("replystream_kv_blocks", "KV cache blocks in the pool.", "kv_blocks_total", "livesum"),
    (
        "replystream_kv_blocks_cached",
        "Free KV cache blocks keeping a prefix for later requests (with --prefix-caching).",
        "kv_blocks_cached",
        "livesum",
    ),
    (
        "replystream_engine_requests_running",
        "Requests in the engine's batch.",
        "running",
        "livesum",
    ),
    (
        "replystream_engine_preemptions",
        "Requests that gave their KV blocks back to make room for others, since start.",
        "preemptions",
        "sum",
    ),
    (
        "replystream_engine_recomputed_tokens",
        "Cached tokens preemptions threw away and readmission computed again, since start.",
        "recomputed_tokens",
        "sum",
    ),
    (
        "replystream_engine_prefix_hit_tokens",
        "Prompt tokens found in cached KV blocks, not computed again, since start.",
        "prefix_hit_tokens",
        "sum",
    ),
)
# A relay's counts over all its upstreams.
_RELAY_GAUGES: tuple[EngineGauge, ...] = (
    (
        "replystream_upstream_failovers",
        "Replies moved to another upstream before their first token, since start.",
        "failovers",
        "sum",
    ),
    (
        "replystream_upstream_continuations",
        "Replies continued at another upstream mid-reply, since start.",
        "continuations",
        "sum",
    ),
    (
        "replystream_upstream_fallbacks",
        "Replies gone on to a fallback model (the routes file's), since start.",
        "fallbacks",
        "sum",
    ),
    (
        "replystream_upstream_affinity_spills",
        "Requests routed by prefix whose first upstream was not their key's own (its load "
        "past the bound, or at its limit of requests at once), since start.",
        "spills",
        "sum",
    ),
    (
        "replystream_upstream_queued",
        "Requests waiting for room at upstreams at their limit of requests at once.",
        "queued",
        "livesum",
    ),
)


def _add_engine_gauges(metrics: Metrics, engine: Engine, gauges: tuple[EngineGauge, ...]) -> None:
    for name, documentation, field, across in gauges:
        metrics.state(name, documentation, _engine_stat(engine, field), across=across)


def _engine_stat(engine: Engine, field: str) -> Callable[[], float]:
    return lambda: float(getattr(engine.stats(), field) or 0)


def _add_batch_gauges(metrics: Metrics, engine: Engine) -> None:
    _add_engine_gauges(metrics, engine, _BATCH_GAUGES)
    metrics.state(
        "replystream_engine_requests_waiting",
        "Requests the engine holds outside its batch: not yet admitted, or preempted.",
        lambda: _waiting(engine.stats()),
    )


def _waiting(stats: EngineStats) -> float:
    return float(stats.active - (stats.running or 0))


async def _publishing_readings(app: web.Application) -> AsyncIterator[None]:
    """While the app runs, write its scrape-time gauges to the shared files periodically, so
    a scrape served by another worker sees this one's state at most that old; and once more
    as it stops, after its replies have ended, so the counts of its last moments (the
    replies a shutdown ended) stay in the totals when the parent restarts it."""
    metrics: Metrics = app[METRICS_KEY]
    loop = asyncio.get_running_loop()
    timer: asyncio.TimerHandle | None = None

    def publish() -> None:
        nonlocal timer
        metrics.refresh_readings()
        timer = loop.call_later(STATE_REFRESH_S, publish)

    publish()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        metrics.refresh_readings()


CIRCUIT_VALUES = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class BackendGauges:
    """Per-upstream state of a relay, one row per upstream routed to now: each circuit,
    probe, outstanding count, and attempts and probes by result, read from ``stats()``.
    ``sync`` follows the routes when they change: rows for upstreams that joined, none for
    those taken out (with workers, left out of scrapes: their files keep them)."""

    def __init__(self, metrics: Metrics, engine: Engine) -> None:
        self._metrics = metrics
        self._engine = engine
        self._rows: dict[str, list[tuple[str, dict[str, str]]]] = {}

    def sync(self) -> None:
        names = {b.name for b in self._engine.stats().backends}
        for name in [n for n in self._rows if n not in names]:
            for family, labels in self._rows.pop(name):
                self._metrics.forget(family, **labels)
        for name in sorted(names - self._rows.keys()):
            self._rows[name] = self._add(name)

    def _reading(self, name: str, read: Callable[[BackendStats], float]) -> Callable[[], float]:
        def reading() -> float:
            for backend in self._engine.stats().backends:
                if backend.name == name:
                    return read(backend)
            return 0.0  # taken out of the routes, between a reload and its ``sync``

        return reading

    def _add(self, name: str) -> list[tuple[str, dict[str, str]]]:
        rows: list[tuple[str, dict[str, str]]] = []

        def state(
            family: str,
            documentation: str,
            read: Callable[[BackendStats], float],
            across: AcrossWorkers = "livesum",
            **labels: str,
        ) -> None:
            labels["upstream"] = name
            reading = self._reading(name, read)
            self._metrics.state(family, documentation, reading, across=across, **labels)
            rows.append((family, labels))

        state(
            "replystream_upstream_circuit",
            "An upstream's circuit: 0 closed (in use), 1 half open (one trial), 2 open (out).",
            lambda b: CIRCUIT_VALUES[b.circuit],
            across="livemax",  # each worker has its own circuit: the most open one
        )
        state(
            "replystream_upstream_probe_ok",
            "Whether an upstream's last health probe answered (1), or not (0; -1 not probed).",
            lambda b: {True: 1.0, False: 0.0, None: -1.0}[b.probe_ok],
            across="livemin",  # each worker probes for itself: 1 only if every one answered
        )
        state(
            "replystream_upstream_outstanding",
            "Requests an upstream is serving now.",
            lambda b: float(b.outstanding),
        )
        state(
            "replystream_upstream_max_outstanding",
            "An upstream's limit of requests at once, for the whole server (-1: none).",
            lambda b: -1.0 if b.max_outstanding is None else float(b.max_outstanding),
            across="livemax",  # every worker reads the same routes (during a reload: the most)
        )
        state(
            "replystream_upstream_slots_taken",
            "Requests at once an upstream is sent by the whole server, as its limit counts "
            "them: with workers, the slots every worker holds (-1: it has no limit).",
            lambda b: -1.0 if b.slots_taken is None else float(b.slots_taken),
            across="livemax",  # each worker reads the same shared slots
        )
        for result in ATTEMPT_RESULTS:
            state(
                "replystream_upstream_attempts",
                "Requests sent to an upstream since start, by result (a count, read on scrape).",
                _count("attempts", result),
                across="sum",
                result=result,
            )
        state(
            "replystream_upstream_connections_opened",
            "Connections opened to an upstream since start (a request on one kept alive opens "
            "none; a count, read on scrape).",
            lambda b: float(b.connections),
            across="sum",
        )
        state(
            "replystream_upstream_connections_idle",
            "An upstream's kept-alive connections idle now.",
            lambda b: float(b.idle_connections),
        )
        for result in ("ok", "failed"):
            state(
                "replystream_upstream_probes",
                "Active health probes of an upstream since start, by result.",
                _count("probes", result),
                across="sum",
                result=result,
            )
        return rows


def _count(field: str, result: str) -> Callable[[BackendStats], float]:
    return lambda b: float(dict(getattr(b, field)).get(result, 0))


def add_backend_gauges(metrics: Metrics, engine: Engine) -> BackendGauges | None:
    """A relay's per-upstream metrics (None for an engine that relays to no one)."""
    if not engine.stats().backends:
        return None
    gauges = BackendGauges(metrics, engine)
    gauges.sync()
    metrics.only_current("upstream", lambda: {b.name for b in engine.stats().backends})
    metrics.histogram_on_scrape(
        "replystream_upstream_time_to_first_token_seconds",
        "Per upstream: time from an attempt's start (a connect included) to the first text "
        "read from it, for every attempt that sent text.",
        "upstream",
        LATENCY_BOUNDS,
        lambda: [(b.name, b.first_text_counts, b.first_text_sum) for b in engine.stats().backends],
    )
    _add_engine_gauges(metrics, engine, _RELAY_GAUGES)
    return gauges


def _log_count(store: ReplayStore) -> Callable[[], float]:
    return lambda: store.stats().replies


# What reply logs lost, and what was done about it (counts since the process started).
_FAULTS = (
    ("gaps", "replystream_reply_log_gaps", "Reads told that events a reader needed are lost."),
    (
        "lost_writes",
        "replystream_reply_log_lost_writes",
        "Times the store found Redis had lost writes it acknowledged (a failover).",
    ),
    (
        "repairs",
        "replystream_reply_log_repairs",
        "Reply logs written again from their producer's copy after Redis lost part of them.",
    ),
    (
        "repaired_events",
        "replystream_reply_log_repaired_events",
        "Events written again to Redis after it lost them.",
    ),
    (
        "holes",
        "replystream_reply_log_holes",
        "Events Redis lost that their producer no longer held (readers are told of a gap).",
    ),
    (
        "evictions",
        "replystream_reply_log_evictions",
        "Reply logs or metadata found evicted by a maxmemory Redis (told, or written again).",
    ),
)


def _log_faults(metrics: Metrics, stores: list[tuple[str, ReplayStore]]) -> None:
    for label, store in stores:
        for field, name, documentation in _FAULTS:
            metrics.state(name, documentation, _stat(store, field), across="sum", store=label)


def _stat(store: ReplayStore, field: str) -> Callable[[], float]:
    return lambda: float(getattr(store.stats(), field))
