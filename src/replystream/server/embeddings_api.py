"""``POST /v1/embeddings``: OpenAI's embeddings route, relayed to the upstreams.

This file decides what the route accepts (OpenAI's fields: ``input`` as a string, strings,
token ids or lists of them, ``encoding_format``, ``dimensions``, ``user``; anything else is
refused, as on every route) and what it answers: the upstream's answer under the model name
asked for, its prompt tokens counted per API key in ``/metrics`` as a reply's are. An engine
that makes no embeddings (every one but a relay's: a chat model is not an embedding model)
answers 404 in OpenAI's shape, saying so. Which upstream answers, and what its failures
mean, is the engine's (``engine.upstream_embeddings``). Shutdown treats a request in
flight as a buffered reply: the grace period waits for its answer, and one still coming then
is a 503 ``shutdown``, as is a request made once shutdown has begun. It must not know how
the upstream is reached.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field, PlainValidator

from replystream.engine.base import Embedder, Embeddings
from replystream.server.access_log import ACCOUNT
from replystream.server.context import (
    ENGINE_KEY,
    KEY_LABEL_CHARS,
    MANAGER_KEY,
    METRICS_KEY,
    admitted,
    caller_of,
    owner_of,
    refuse_when_stopping,
    shutting_down,
)
from replystream.server.errors import HTTPAPIError
from replystream.server.front_door import expect_later
from replystream.server.openai_api import routed_model, served_model
from replystream.server.schema_fields import Strict, invalid
from replystream.server.validation import read_model

ENDPOINT = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's most inputs in one request
# A token id past any vocabulary (2^31, what 32-bit ids hold), and more dimensions than any
# embedding model makes: out of range here, never an upstream's 5xx counted on its circuit.
MAX_TOKEN_ID = (1 << 31) - 1
MAX_DIMENSIONS = 1 << 16


def _one_input(value: Any, where: str, index: int | None = None) -> str | list[int]:
    """One input (``where``: its path; ``index``: its place in the list, which the error's
    ``param`` names after ``input``)."""
    if isinstance(value, str):
        if not value:
            raise invalid(f"{where} must not be an empty string", param=index)
        return value
    if isinstance(value, list) and value:
        for token in value:
            if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
                raise invalid(
                    f"{where} must be a string or a list of token ids (integers from 0 to "
                    f"{MAX_TOKEN_ID})",
                    param=index,
                )
        return value
    raise invalid(
        f"{where} must be a non-empty string or a non-empty list of token ids", param=index
    )


def _input(value: Any) -> str | list[int] | list[str | list[int]]:
    """OpenAI's four shapes: a string, strings, token ids, lists of token ids (a list of
    inputs of one kind)."""
    if isinstance(value, str):
        return _one_input(value, "input")
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list (of strings or token ids)")
    if all(type(item) is int for item in value):
        return _one_input(value, "input")  # one input, as token ids
    if len(value) > MAX_INPUTS:
        raise invalid(f"input may hold at most {MAX_INPUTS} inputs; it holds {len(value)}")
    kinds = {type(item) for item in value}
    if len(kinds) > 1:
        raise invalid("input must hold inputs of one kind: all strings or all lists of token ids")
    return [_one_input(item, f"input[{i}]", i) for i, item in enumerate(value)]


class EmbeddingsBody(Strict):
    """``POST /v1/embeddings``."""

    input: Annotated[Any, PlainValidator(_input)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = None
    user: str | None = None


async def handle_embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``: the upstream's embeddings of ``input``."""
    app = request.app
    engine = app[ENGINE_KEY]
    if not isinstance(engine, Embedder):
        raise HTTPAPIError(
            404,
            f"this server's engine ({engine.name}) makes no embeddings: /v1/embeddings is "
            "served by a relay (--engine upstream:URL), whose upstreams make them",
            code="unsupported_endpoint",
        )
    body = await read_model(request, EmbeddingsBody)
    routed = routed_model(app, body.model)
    fields = body.model_dump(exclude_none=True, exclude={"model"})
    record = app[METRICS_KEY].record(ENDPOINT, streamed=False)
    record.key = owner_of(request)[:KEY_LABEL_CHARS]
    record.queues = False  # (its answer comes whole: the upstream's time is no queue's)
    request[ACCOUNT] = record
    refuse_when_stopping(request, record)
    work = asyncio.ensure_future(
        engine.embed(fields, routed, routed or served_model(app), caller_of(request))
    )
    app[MANAGER_KEY].hold(work)
    try:
        answer = await admitted(request, record, _unless_shut_down(work))
    except _ShutDown:
        record.outcome, record.reason = "shutdown", "shutdown"
        app[METRICS_KEY].observe(record)
        raise shutting_down() from None
    record.outcome = "finished"
    record.prompt_tokens = answer.prompt_tokens or 0
    app[METRICS_KEY].observe(record)
    return web.Response(body=answer.body, content_type="application/json")


class _ShutDown(Exception):
    """Shutdown cancelled the request's answer after the grace period."""


async def _unless_shut_down(work: asyncio.Future[Embeddings]) -> Embeddings:
    """``work``'s answer; ``_ShutDown`` when shutdown cancelled it (a client that leaves
    cancels this task, and ``work`` with it: that cancellation goes on)."""
    try:
        return await work
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if work.cancelled() and task is not None and not task.cancelling():
            raise _ShutDown from None
        raise


def add_embeddings_route(app: web.Application) -> None:
    """Register ``POST /v1/embeddings`` on ``app``."""
    app.router.add_post(ENDPOINT, handle_embeddings, expect_handler=expect_later)
