"""Embeddings relayed: ``POST {base}/embeddings`` to the upstreams serving a request's model,
one after another until one answers.

This file decides how one embeddings request goes upstream: to the first upstream of the
pool's plan for its model with room (waiting in line, as a chat request does, while every one
left is at its limit of requests at once, for at most ``queue_s``); a connection that fails,
no answer within the head timeout, a 5xx or a 429 counts on that upstream's circuit (as a chat
attempt's does: ``NOT_ITS_HEALTH``) and the next upstream is tried, until ``failover_s`` has
passed since the request began; an upstream without the route (one serving chat alone:
``UpstreamLacksRoute``, and one whose model makes a vector per token, none per text) is
passed over with no mark on its circuit; a refusal of the request
itself (a 4xx) is the client's answer, from the first upstream that gave it. The answer is
relayed whole and as the upstream wrote it (``encoding_format`` is passed on: base64 stays
base64), but for its ``model``, the name the client asked for (an alias's, as a chat reply
names it), once checked without holding the loop (``embeddings_answer``). A model's
fallbacks are never tried: another model's vectors lie in another space, and mixed into one
index they would break its searches without a word. Each attempt's end is counted on its
upstream and logged as a chat attempt's is (``replystream.access``). It must not know about
our HTTP server.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic_core import to_json

from replystream.engine.base import Caller, Embeddings, EngineError, RequestRejected
from replystream.engine.embeddings_answer import checked_answer
from replystream.engine.upstream_admission import Hold, take_one
from replystream.engine.upstream_attempts import gave_up, log_attempt, no_room
from replystream.engine.upstream_http_connection import Response
from replystream.engine.upstream_http_failures import HttpFailure
from replystream.engine.upstream_pool import Backend, UpstreamPool
from replystream.engine.upstream_queue import RoomQueue
from replystream.engine.upstream_refusals import (
    UpstreamLacksRoute,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from replystream.engine.upstream_relay_types import (
    AT_HEAD,
    NOT_ITS_HEALTH,
    RelayLimits,
)
from replystream.engine.upstream_slots import SharedLimits

# The largest answer relayed: 2,048 inputs (OpenAI's most per request) of 4,096 dimensions
# are about 45 MB in base64 (the official SDKs' default) and 100 MB as JSON numbers.
MAX_ANSWER_BYTES = 128 * 1024 * 1024

# An answer whose first item's embedding is a list of vectors, one per token of its input:
# llama-cpp-python's server (0.3.36) for a model that pools none into one vector of the text
# (a chat model's GGUF, started with ``--embedding``): ``"embedding":[[-0.54,...],...]``. Its
# first item is near the answer's start, so only that much is searched.
_PER_TOKEN = re.compile(rb'"embedding"\s*:\s*\[\s*\[\s*-?[0-9]')
_PER_TOKEN_SEARCHED = 64 * 1024

# Sends a body to ``POST {backend}/embeddings`` and returns the response once its head came
# (raising an ``EngineError`` for a failure before then), with ``caller`` (its key, request
# id and trace context) as the upstream is to see it, within the given seconds.
Poster = Callable[[Backend, bytes, Caller, float], Awaitable[Response]]
# What an answer other than 200 means (``upstream_refusals.refusal``), for that backend.
Refusal = Callable[[Response, Backend, Caller], Awaitable[EngineError]]


class EmbeddingsRelay:
    """One embeddings request's attempts, one upstream after another."""

    def __init__(
        self,
        *,
        pool: UpstreamPool,
        shared: SharedLimits | None,
        queue: RoomQueue,
        limits: RelayLimits,
        headers_timeout_s: float,
        post: Poster,
        refusal: Refusal,
    ) -> None:
        self._pool = pool
        self._shared = shared
        self._queue = queue
        self._limits = limits
        self._headers_timeout_s = headers_timeout_s
        self._post = post
        self._refusal = refusal

    async def relay(
        self, fields: dict[str, Any], model: str | None, answer_as: str, caller: Caller
    ) -> Embeddings:
        """``fields`` (the client's, but its model) sent as ``model`` (None: to any upstream,
        as it serves it, with no model named); the answer named ``answer_as``.

        Raises:
            RequestRejected: an upstream refused the request itself.
            EngineError: no upstream answered within the failover bound (the last failure),
                or none can take a request now (``NoUpstream``, ``UpstreamBusy``: 503).
        """
        body = to_json(fields if model is None else {**fields, "model": model})
        began = time.monotonic()
        tried: set[Backend] = set()
        last_error: EngineError | None = None
        queued_at: float | None = None
        while True:
            now = time.monotonic()
            left = self._limits.failover_s - (now - began)
            if tried and left <= 0:
                raise gave_up(self._pool, (model,), last_error, len(tried))
            backend, slot, full = take_one(
                self._pool, self._shared, model, None, tried, queued_at or now
            )
            if backend is None:
                if not full:
                    raise gave_up(self._pool, (model,), last_error, len(tried))
                again, queued_at = queued_at is not None, queued_at or now
                wait = self._limits.queue_s - (now - queued_at)
                if wait > 0 and await self._queue.wait(model, wait, queued_at, again=again):
                    began += time.monotonic() - now  # time in line is not the window's
                    continue
                raise no_room((model,), self._limits.queue_s, time.monotonic() - queued_at)
            hold = Hold(backend, slot)
            tried.add(backend)
            attempt_began = time.monotonic()
            result = "cancelled"
            try:
                answer = await self._attempt(backend, body, answer_as, caller, max(left, 0.001))
                result = "ok"
                return answer
            except RequestRejected:
                result = "rejected"  # the request, not the upstream: no other is tried
                raise
            except EngineError as exc:
                result = AT_HEAD.get(exc.code, "connect_error")
                last_error = exc
                if exc.code not in NOT_ITS_HEALTH:
                    self._pool.failed(
                        backend, str(exc), exc.retry_after_s or 0.0, lasting=exc.lasting
                    )
                # (A 404 for the model, or an answer, is this route's word on it alone:
                # ``UpstreamPool.not_serving`` and ``served`` keep chat's.)
            finally:
                if result == "ok":
                    backend.succeeded()
                hold.give_back(self._queue)
                backend.attempts[result] += 1
                if result != "ok" or len(tried) > 1:
                    log_attempt(caller.request_id, backend, len(tried), result, attempt_began)

    async def _attempt(
        self, backend: Backend, body: bytes, answer_as: str, caller: Caller, within_s: float
    ) -> Embeddings:
        # One deadline for the head and the body: an upstream answers when its vectors are
        # made, all of them at once.
        timeout = min(self._headers_timeout_s, within_s)
        due = asyncio.get_running_loop().time() + timeout
        response = await self._post(backend, body, caller, timeout)
        where = f"the upstream at {backend.name}"
        if response.status != 200:  # a route it lacks is ``UpstreamLacksRoute``: not its health
            raise await self._refusal(response, backend, caller)
        encoding = response.content_encoding
        if encoding:  # asked for none (``Accept-Encoding: identity``): no JSON to read
            response.close()
            named = f"{encoding}-" if encoding.isascii() and encoding.isalnum() else ""
            raise UpstreamUnavailable(
                f"{where} answered a {named}compressed body, though asked for none",
                code="upstream_bad_response",
            )
        try:
            async with asyncio.timeout_at(due):
                raw = await response.read_whole(MAX_ANSWER_BYTES)
        except TimeoutError:
            response.close()
            raise UpstreamTimeout(
                f"{where} did not send its whole answer within {timeout:.3g} s",
                code="upstream_timeout",
            ) from None
        except (HttpFailure, OSError):
            raise UpstreamUnavailable(
                f"{where} closed the connection mid-answer", code="upstream_bad_response"
            ) from None
        if raw is None:
            raise UpstreamUnavailable(
                f"{where} answered more than {MAX_ANSWER_BYTES} bytes of embeddings",
                code="upstream_bad_response",
            )
        answer = await checked_answer(raw, answer_as)
        if answer is None and _PER_TOKEN.search(raw, 0, _PER_TOKEN_SEARCHED):
            # What it makes of this model, not a sign of sickness: counted on its circuit,
            # three requests would take it out of chat's routing too, for every client.
            raise UpstreamLacksRoute(
                f"{where} answered POST /embeddings with a vector for each token of an input, "
                "not one for the input: its model makes no embedding of a text (a model "
                "without pooling, as a chat model's GGUF is to llama-cpp-python's server)",
                code="route_unsupported",
            )
        if answer is None:
            raise UpstreamUnavailable(
                f"{where} answered something other than a list of embeddings ({len(raw)} bytes)",
                code="upstream_bad_response",
            )
        return answer
