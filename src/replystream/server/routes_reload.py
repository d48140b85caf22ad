"""Reading the relay's routes file again while it serves (``kill -HUP``), as nginx and HAProxy
reload theirs: no restart, no stream cut.

This file decides when the file is read again and what is said about it: on each SIGHUP,
one reload at a time (a signal during a reload reads the file once more after it, so the
last edit is the one served); a file with a mistake changes nothing, and the routes served
before stay; each reload is one log line (what changed, or the mistake, as ``serve`` would
name it at start-up) and one count in ``replystream_upstream_routes_reloads_total`` by
result. What the file means is ``upstream_routes``'s; how routing changes is
``UpstreamEngine.reroute``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import Counter

from replystream.engine.upstream import RouteChange, UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig
from replystream.server.context import ENGINE_KEY, METRICS_KEY
from replystream.server.engine_options import EngineChoice, upstream_config
from replystream.server.metrics import Metrics
from replystream.server.state import BACKEND_GAUGES_KEY

log = logging.getLogger("replystream.upstream")


def change_line(path: str, change: RouteChange) -> str:
    """``routes reloaded from routes.toml: 3 upstreams (added ..., removed ...), 1 alias``."""
    moves = [f"added {', '.join(change.added)}"] if change.added else []
    if change.removed:
        moves.append(f"removed {', '.join(change.removed)}")
    upstreams = f"{change.upstreams} upstream{'s' * (change.upstreams != 1)}"
    if moves:
        upstreams += f" ({'; '.join(moves)})"
    aliases = f"{change.aliases} alias{'es' * (change.aliases != 1)}"
    return f"routes reloaded from {path}: {upstreams}, {aliases}"


class RoutesReloader:
    """Re-reads the routes (``read``: the whole relay configuration, as at start-up) into
    ``engine`` when asked, and tells ``on_change`` when the upstreams may have changed."""

    def __init__(
        self,
        path: str,
        read: Callable[[], UpstreamConfig],
        engine: UpstreamEngine,
        metrics: Metrics,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._path = path
        self._read = read
        self._engine = engine
        self._on_change = on_change
        self._reloads = Counter(
            "replystream_upstream_routes_reloads",
            "Times the routes file was read again (SIGHUP), by result: ok, or failed (a "
            "mistake in it: the routes served before stay).",
            ["result"],
            registry=metrics.registry,
        )
        for result in ("ok", "failed"):
            self._reloads.labels(result)  # both rows from the start, at 0
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def hangup(self) -> None:
        """A SIGHUP: reload now, or once more after the reload under way."""
        if self._task is not None:
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="routes-reload")

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                try:
                    await self.reload()
                except Exception:  # a bug: said, and the server serves on
                    self._reloads.labels("failed").inc()
                    log.exception("routes not reloaded")
                if not self._again:
                    return
        finally:
            self._task = None

    async def reload(self) -> None:
        """Read the routes again and serve them, or say why not."""
        try:
            config = self._read()
        except ValueError as exc:
            self._reloads.labels("failed").inc()
            log.error("routes not reloaded, the previous ones stay: %s", exc)
            return
        change = await self._engine.reroute(config)
        self._on_change()
        self._reloads.labels("ok").inc()
        # At the default level, as the start-up lines are: the operator who sent the signal
        # is told it was taken.
        log.warning("%s", change_line(self._path, change))


def reloader_for(
    app: web.Application, args: argparse.Namespace, choice: EngineChoice
) -> RoutesReloader:
    """The reloader of a relay ``app`` serving ``serve``'s ``args`` (with a routes file)."""
    engine = app[ENGINE_KEY]
    assert isinstance(engine, UpstreamEngine) and args.upstream_routes is not None
    gauges = app.get(BACKEND_GAUGES_KEY)
    return RoutesReloader(
        args.upstream_routes,
        lambda: upstream_config(args, choice),
        engine,
        app[METRICS_KEY],
        on_change=(lambda: None) if gauges is None else gauges.sync,
    )
