"""Reading ``serve``'s files again while it serves (``kill -HUP``), as nginx and HAProxy reload
theirs: no restart, no stream cut. The files: the relay's routes (``--upstream-routes``), the
API keys (``--api-keys-file``) and the banned phrases (``--ban-file``); the command line
itself is not read again.

This file decides when the files are read again and what is said about it: on each SIGHUP,
every file in turn, one reload at a time (a signal during a reload reads them once more after
it, so the last edit is the one served); a file with a mistake changes nothing, and what was
served before stays; each file's reload is one log line (what changed, or the mistake, as
``serve`` would name it at start-up) and one count in ``replystream_reloads_total`` by file
and result. What a file means is its reader's (``upstream_routes``, ``api_keys``,
``text_files``); how the server takes it is its owner's (``UpstreamEngine.reroute``,
``KeyRing.replace``, ``BannedPhrases.replace``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import Counter

from replystream.delivery.moderation import BannedPhrases
from replystream.engine.upstream import RouteChange, UpstreamEngine
from replystream.server.api_keys import collect_keys
from replystream.server.auth import KEY_RING
from replystream.server.context import ENGINE_KEY, METRICS_KEY
from replystream.server.engine_options import EngineChoice, idle_upstream_flag, upstream_config
from replystream.server.metrics import Metrics
from replystream.server.state import BACKEND_GAUGES_KEY
from replystream.server.text_files import banned_phrases

log = logging.getLogger("replystream.server")


@dataclass(frozen=True, slots=True)
class ReloadedFile:
    """One file SIGHUP reads again: ``apply`` reads it and serves what it says, and returns
    the line that says what changed; it raises ``ValueError`` (or ``OSError``) for a file it
    cannot take, having changed nothing."""

    label: str  # the metric's ``file`` label, and the log's name for it
    apply: Callable[[], Awaitable[str]]


class Reloads:
    """What a SIGHUP does: each file read again, in turn, one round at a time."""

    def __init__(self, metrics: Metrics, files: Sequence[ReloadedFile]) -> None:
        self._files = tuple(files)
        self._count = Counter(
            "replystream_reloads",
            "Times a file was read again on SIGHUP, by file (api_keys, ban, routes) and result: "
            "ok, or failed (a mistake in it: what was served before stays).",
            ["file", "result"],
            registry=metrics.registry,
        )
        for file in self._files:
            for result in ("ok", "failed"):
                self._count.labels(file.label, result)  # every row from the start, at 0
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def hangup(self) -> None:
        """A SIGHUP: read the files now, or once more after the round under way."""
        if self._task is not None:
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="reload")

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                for file in self._files:
                    await self._reload(file)
                if not self._again:
                    return
        finally:
            self._task = None

    async def _reload(self, file: ReloadedFile) -> None:
        try:
            said = await file.apply()
        except (ValueError, OSError) as exc:
            self._count.labels(file.label, "failed").inc()
            log.error("%s not reloaded, what was served before stays: %s", file.label, exc)
            return
        except Exception:  # a bug: said, and the server serves on
            self._count.labels(file.label, "failed").inc()
            log.exception("%s not reloaded", file.label)
            return
        self._count.labels(file.label, "ok").inc()
        # At the default level, as the start-up lines are: the operator who sent the signal
        # is told it was taken.
        log.warning("%s", said)


def change_line(path: str, change: RouteChange) -> str:
    """``routes reloaded from routes.toml: 3 upstreams (added ..., removed ...), 1 alias``,
    then ``, 2 models with fallbacks`` when any are."""
    moves = [f"added {', '.join(change.added)}"] if change.added else []
    if change.removed:
        moves.append(f"removed {', '.join(change.removed)}")
    upstreams = f"{change.upstreams} upstream{'s' * (change.upstreams != 1)}"
    if moves:
        upstreams += f" ({'; '.join(moves)})"
    aliases = f"{change.aliases} alias{'es' * (change.aliases != 1)}"
    if change.fallbacks:
        aliases += f", {change.fallbacks} model{'s' * (change.fallbacks != 1)} with fallbacks"
    return f"routes reloaded from {path}: {upstreams}, {aliases}"


def reloads_for(
    app: web.Application,
    args: argparse.Namespace,
    choice: EngineChoice,
    phrases: BannedPhrases | None,
) -> Reloads | None:
    """What SIGHUP reads again for ``serve``'s ``args``: the API keys file, the banned phrases
    file (into ``phrases``, the check every reply reads), the relay's routes file; None when
    it names none (SIGHUP then stops the server as SIGTERM does)."""
    files = []
    # The keys and the phrases first: a leaked key removed from its file is refused, and a
    # leaked phrase added to its file stopped, at once, not after the routes' reload has
    # probed its new upstreams (up to 2 s for one that does not answer).
    ring = app.get(KEY_RING)
    if ring is not None and args.api_keys_file is not None:
        keys_file = Path(args.api_keys_file)

        async def rekey() -> str:
            keys = collect_keys(args.api_key, keys_file)
            ring.replace(keys)
            return f"API keys reloaded from {keys_file}: {len(keys)} key{'s' * (len(keys) != 1)}"

        files.append(ReloadedFile("api_keys", rekey))
    if phrases is not None and args.ban_file is not None:
        ban_file = Path(args.ban_file)

        async def reban() -> str:
            listed = banned_phrases(args.ban, ban_file)
            phrases.replace(listed)
            # Every reply takes them at its next token, those under way too: a phrase banned
            # because it leaked stops leaking now, not once the replies running have ended.
            count = len(set(listed))
            return f"banned phrases reloaded from {ban_file}: {count} phrase{'s' * (count != 1)}"

        files.append(ReloadedFile("ban", reban))
    engine = app[ENGINE_KEY]
    if isinstance(engine, UpstreamEngine) and args.upstream_routes is not None:
        path: str = args.upstream_routes
        gauges = app.get(BACKEND_GAUGES_KEY)

        async def reroute() -> str:
            config = upstream_config(args, choice)
            idle_flag = idle_upstream_flag(args, config)
            if idle_flag is not None:  # the file is sound; the flag waits for a limit again
                log.warning("%s: until then it does nothing (%s)", path, idle_flag)
            change = await engine.reroute(config)
            if gauges is not None:
                gauges.sync()  # a row for each upstream routed to now
            said = change_line(path, change)
            # As at start-up: routes that leave the server unable to serve (a model the
            # command line names that no upstream lists now) are taken, and said, lest
            # /healthz turn 503 with nothing in the log but "reloaded".
            readiness = await engine.readiness()
            if not readiness.ready:
                said += f"; the engine is not ready: {readiness.reason}; /healthz answers 503"
            return said

        files.append(ReloadedFile("routes", reroute))
    return Reloads(app[METRICS_KEY], files) if files else None
