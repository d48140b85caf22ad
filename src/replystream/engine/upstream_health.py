"""Active health checks of the upstreams: each is asked ``GET {base}{path}`` (``/models`` by
default, cheap on every OpenAI-compatible server) with a short timeout, when the relay starts
and then every ``interval_s`` in the background, over the relay's own HTTP client
(``upstream_http``: the TLS, proxy and failures of a relayed request, on a kept-alive
connection of the probes' own); a model list it answers with tells the pool
which models that upstream serves (even where the routes file names them: whether a model it
answered a chat request 404 for is listed again). An upstream whose probes begin to fail is
logged once, with why, and once more when one answers again. An upstream that takes each
caller's own key is probed without one: its refusal (401, 403) says it is up, and its models
come from the routes file (or from no listing: it is sent any model). One that refuses our
key is told in the words of a refused request: where that key is configured. A listed model
whose name is also an alias stays behind the alias (requests for that name go to the alias's
model, as configured): the first probe that finds one says so in the log, once per alias and
upstream.

This file decides what a probe's answer means (a problem in words, or None) and when probes
run. What a failed probe does to routing is ``upstream_pool``'s. It must not know about our
HTTP server; the session and the upstreams' keys are given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pydantic_core import from_json

from replystream.engine.upstream_config import UpstreamKeys
from replystream.engine.upstream_errors import connect_failure, own_shortage
from replystream.engine.upstream_http import KEEPALIVE_S, HttpOrigin
from replystream.engine.upstream_http_failures import HttpFailure
from replystream.engine.upstream_pool import Backend, UpstreamPool
from replystream.engine.upstream_proxy import CREDENTIALS_ASKED, Proxy, proxy_handshake_s
from replystream.engine.upstream_refusals import (
    BODY_LIMIT,
    front_refusal,
    our_key_refused,
    redirected,
)

log = logging.getLogger("replystream.upstream")

PROBE_TIMEOUT_S = 2.0  # a health check must not hang on a silent upstream
# The most of a ``/models`` answer read for its listing (thousands of models fit in far less);
# past it, as for an answer that is no JSON, the upstream's models stay unknown.
MODELS_BODY_LIMIT = 4 * 1024 * 1024


def listed_models(listing: object) -> list[str]:
    """The model ids of an OpenAI ``GET /models`` answer (none for any other shape); an
    empty id names no model a client could ask for (``GET /v1/models/`` is no route) and
    would end an Anthropic client's paging as a last page does."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return []
    return [
        m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]
    ]


def _listing(body: bytes | None) -> object:
    """The JSON of a ``/models`` answer; None past ``MODELS_BODY_LIMIT`` bytes (``body``
    None) or when it is not JSON (pydantic's parser bounds its nesting, where ``json.loads``
    would recurse)."""
    if body is None:
        return None
    try:
        return from_json(body)
    except ValueError:
        return None


class Verdict(NamedTuple):
    """What a probe found: ``problem`` in words (None: it answered), the models it lists,
    and whether the problem is the relay's configuration of it (``EngineError.lasting``)."""

    problem: str | None
    models: list[str]
    lasting: bool = False


class _NoVerdict(Exception):
    """A probe that could not be sent for this process's own shortage (no file descriptor
    left): the upstream keeps the verdict it had."""


class HealthProber:
    """Probes every upstream now and then, and tells the pool what it found."""

    def __init__(
        self,
        pool: UpstreamPool,
        *,
        keys: UpstreamKeys,
        interval_s: float,
        path: str = "/models",
        timeout_s: float = PROBE_TIMEOUT_S,
        keepalive_s: float = KEEPALIVE_S,
        after_round: Callable[[], None] | None = None,
    ) -> None:
        self._pool = pool
        self._after_round = after_round  # called after each round of every upstream's probe
        # Probes go over the relay's own HTTP client (its TLS, proxies and failures, as a
        # relayed request meets them), on connections of their own: one kept alive per
        # upstream, made again when its TLS or proxy changes (``_origin``).
        self._origins: dict[str, tuple[HttpOrigin, ssl.SSLContext | None, Proxy | None]] = {}
        self._keepalive_s = keepalive_s
        self._interval_s = interval_s
        self._path = path
        # What each upstream is sent, and where it is configured (set again when the routes
        # change). Those that take each caller's own key are probed without one, so a 401
        # or 403 from them says they are up.
        self.keys = keys
        self._timeout_s = min(timeout_s, interval_s)
        self._probed = False
        # (alias, the model it stands for, upstream) already said to shadow a listed model.
        self._shadowed: set[tuple[str, str, str]] = set()
        # The upstreams whose probes fail: since when, and how many have (``_tell``).
        self._failing: dict[str, tuple[float, int]] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def first_round(self) -> None:
        """Probe once if nothing was probed yet, and keep probing in the background."""
        if not self._probed:
            async with self._lock:
                if not self._probed:  # another caller may have probed meanwhile
                    await self.probe_all()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="upstream-health")

    async def probe_all(self) -> None:
        await self.probe(self._pool.backends)
        self._probed = True
        if self._after_round is not None:
            self._after_round()
        served = {b.name for b in self._pool.backends}
        for name in [name for name in self._origins if name not in served]:
            self._origins.pop(name)[0].close()  # out of the routes
        for name in [name for name in self._failing if name not in served]:
            del self._failing[name]

    def _origin(self, name: str, keys: UpstreamKeys) -> HttpOrigin:
        """The probes' connections to the upstream ``name``, reached as ``keys`` say."""
        tls, proxy = keys.tls.get(name), keys.proxies.get(name)
        kept = self._origins.get(name)
        if kept is not None and kept[1] is tls and kept[2] == proxy:
            return kept[0]
        if kept is not None:
            kept[0].close()
        origin = HttpOrigin(
            name,
            max_idle=1,
            keepalive_s=self._keepalive_s,
            tls=tls,
            proxy=proxy,
            proxy_handshake_s=proxy_handshake_s(self._timeout_s),
        )
        self._origins[name] = origin, tls, proxy
        return origin

    async def probe(self, backends: Sequence[Backend], *, keys: UpstreamKeys | None = None) -> None:
        """Probe ``backends`` at once: those of the pool, or ones about to join it (with the
        ``keys`` they will have there)."""
        keys = keys or self.keys
        async with asyncio.TaskGroup() as group:
            for backend in backends:
                group.create_task(self._probe(backend, keys))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.probe_all()
            except Exception:  # a bug here must not stop the probing for good
                log.exception("upstream health probe failed")

    async def _probe(self, backend: Backend, keys: UpstreamKeys) -> None:
        try:
            problem, models, lasting = await self._ask(backend, keys)
        except _NoVerdict:
            return  # this process's shortage says nothing of the upstream: as it was
        backend.probed(problem, models, lasting=lasting)
        self._tell(backend.name, problem)
        self._pool.listed(backend, models)  # a model it answered 404 for may be back
        self.note_shadowed([backend])

    def _tell(self, name: str, problem: str | None) -> None:
        """Log an upstream's probes as they begin to fail, with why, and as one answers
        again, not each probe in between: at the default level nothing else tells of an
        upstream passed over (gone dark, down, or refusing the probe), as requests fail
        over from it without a word."""
        failing = self._failing.get(name)
        if problem is None:
            if failing is not None:
                del self._failing[name]
                since, count = failing
                log.warning(
                    "the upstream at %s answers its health probe again, after failing for "
                    "%.1f s (%d probes)",
                    name,
                    time.monotonic() - since,
                    count,
                )
            return
        if failing is not None:
            self._failing[name] = (failing[0], failing[1] + 1)
            return
        self._failing[name] = (time.monotonic(), 1)
        log.warning(
            "health probe: %s; requests go to the other upstreams serving the model, if any, "
            "while its probes fail (told again once one answers)",
            problem,
        )

    def note_shadowed(self, backends: Sequence[Backend]) -> None:
        """Log, once, each alias whose name is a model one of ``backends`` lists: the alias
        wins (the routes file says where its name goes), so that upstream's own model of
        that name is never reached by it, and an operator should know."""
        aliases = self._pool.aliases
        for backend in backends:
            for alias in aliases.keys() & backend.models:
                said = (alias, aliases[alias], backend.name)
                if said in self._shadowed:
                    continue
                self._shadowed.add(said)
                log.warning(
                    "the upstream at %s lists a model named %r, which is also an alias (for "
                    "%r): requests for %r go to %r, as the alias says; rename the alias to "
                    "reach that upstream's own %r",
                    backend.name,
                    alias,
                    aliases[alias],
                    alias,
                    aliases[alias],
                    alias,
                )

    async def _ask(self, backend: Backend, keys: UpstreamKeys) -> Verdict:
        where = f"the upstream at {backend.name}"
        headers = keys.headers(backend.name)
        listing: object = None
        front = None
        try:
            async with asyncio.timeout(self._timeout_s):
                # Redirects are not followed, as the relay's requests do not follow them: a
                # probe that did would call an upstream every request fails at healthy.
                response = await self._origin(backend.name, keys).get(self._path, headers)
                status, location = response.status, response.location
                listing_asked = status == 200 and self._path == "/models"
                body = await response.read_whole(MODELS_BODY_LIMIT if listing_asked else BODY_LIMIT)
                if listing_asked and not response.content_encoding:
                    listing = _listing(body)
                elif status == 400 and body is not None:
                    front = front_refusal(status, body)
        except TimeoutError:
            return Verdict(f"{where} did not answer within {self._timeout_s:g} s", [])
        except (HttpFailure, OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            if own_shortage(exc) is not None:  # no file descriptor left here for the probe
                raise _NoVerdict from None
            shows = backend.name in keys.certified
            failure = connect_failure(exc, backend.name, shows_certificate=shows)
            return Verdict(failure.message, [], failure.lasting)
        if front is not None:
            return Verdict(f"{where} answered {status}: {front}", [], lasting=True)
        if 300 <= status < 400:
            where_to = redirected(location, keys.withheld(backend.name, None))
            return Verdict(f"{where} answered {status}: {where_to}", [], lasting=True)
        if status == 407:  # a proxy's, on the way to an http upstream
            return Verdict(f"{where} answered 407: {CREDENTIALS_ASKED}", [], lasting=True)
        if status in (401, 403) and backend.name in keys.passing:
            return Verdict(None, [])
        if status in (401, 403):
            refused = our_key_refused(keys.key_from(backend.name))
            return Verdict(f"{where} answered {status}: {refused}", [], lasting=True)
        if status == 404:
            # The probe's path follows the base URL: a wrong base is the likelier mistake for
            # the default path, a path of the operator's own for any other.
            hint = (
                "does the URL end in /v1?"
                if self._path == "/models"
                else "the probe's path is asked after the base URL (--upstream-health-path)"
            )
            return Verdict(f"{where} has no {self._path} (404): {hint}", [], lasting=True)
        if status >= 500:
            return Verdict(f"{where} answered {status} to GET {self._path}", [])
        return Verdict(None, listed_models(listing))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for origin, _, _ in self._origins.values():
            origin.close()
        self._origins.clear()
