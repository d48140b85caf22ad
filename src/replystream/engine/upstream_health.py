"""Whether the upstreams can serve: each is asked ``GET {base}/models`` (cheap on every
OpenAI-compatible server) with a short timeout, when the relay starts and again whenever the
answer is older than ``interval_s``; relayed requests also tell it what they met.

This file decides what counts as ready (every upstream answered its model list) and how old
an answer may be. It must not know about our HTTP server; the session and headers are given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from replystream.engine.base import READY, Readiness
from replystream.engine.upstream_errors import connect_failure

PROBE_INTERVAL_S = 5.0  # an answer older than this is asked again
PROBE_TIMEOUT_S = 2.0  # a health check must not hang on a silent upstream


class UpstreamHealth:
    """The last known state of each upstream (None: fine; else what is wrong, in words)."""

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        interval_s: float = PROBE_INTERVAL_S,
        timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._problems: dict[str, str | None] = dict.fromkeys(base_urls, "not checked yet")
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._checked_at: float | None = None
        self._lock = asyncio.Lock()

    def saw(self, base_url: str, problem: str | None) -> None:
        """What a relayed request met (a refused connection, or a stream that started)."""
        self._problems[base_url] = problem

    def current(self) -> Readiness:
        problems = [p for p in self._problems.values() if p is not None]
        return Readiness(False, "; ".join(problems)) if problems else READY

    async def readiness(
        self, session: aiohttp.ClientSession, headers: Mapping[str, str]
    ) -> Readiness:
        """Ready when every upstream answered; asks them again when the answer is old."""
        if not self._fresh():
            async with self._lock:
                if not self._fresh():  # another health check may have asked meanwhile
                    async with asyncio.TaskGroup() as group:
                        for base_url in self._problems:
                            group.create_task(self._probe(session, headers, base_url))
                    self._checked_at = self._clock()
        return self.current()

    def _fresh(self) -> bool:
        at = self._checked_at
        return at is not None and self._clock() - at < self._interval_s

    async def _probe(
        self, session: aiohttp.ClientSession, headers: Mapping[str, str], base_url: str
    ) -> None:
        where = f"the upstream at {base_url}"
        try:
            async with asyncio.timeout(self._timeout_s):
                async with session.get(f"{base_url}/models", headers=headers) as response:
                    status = response.status
        except TimeoutError:
            self._problems[base_url] = f"{where} did not answer within {self._timeout_s:g} s"
            return
        except aiohttp.ClientError as exc:
            self._problems[base_url] = connect_failure(exc, base_url, self._timeout_s).message
            return
        if status in (401, 403):
            problem: str | None = f"{where} refused our API key ({status})"
        elif status == 404:
            problem = f"{where} has no model list (404): does the URL end in /v1?"
        elif status >= 500:
            problem = f"{where} answered {status} to GET /models"
        else:
            problem = None  # it speaks HTTP and knows the route: requests can go there
        self._problems[base_url] = problem
