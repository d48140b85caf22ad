"""HTTP routes and the application factory.

Routes:
- ``GET /wait`` and ``GET /stream``: the lab's two deliveries of the same generation (a JSON
  body ``{"text": ...}``, or one ``data: "<token>"`` event per token then ``data: [DONE]``);
  query parameters ``prompt``, ``seed``, ``max_tokens``.
- ``POST /v1/replies``: the native endpoint (named events, delivery policies, ``stream``).
- ``GET /metrics`` (Prometheus text format) and ``GET /healthz``.
Requests become generations here; how they are delivered is ``server.delivery``'s job.
It must not know how tokens are made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from replystream.delivery.moderation import Violation
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import (
    DeltaStream,
    Engine,
    EngineError,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
)
from replystream.server.delivery import (
    ActiveReplies,
    ReplyContext,
    buffered_reply,
    stream_reply,
)
from replystream.server.errors import HTTPAPIError, error_response
from replystream.server.formats import LabFormat, NativeFormat, Usage, moderated_payload
from replystream.server.metrics import Metrics, ReplyRecord
from replystream.server.native import parse_reply_request, read_json_object

log = logging.getLogger("replystream.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Server-wide settings; the delivery policy holds the per-request defaults."""

    policy: DeliveryPolicy = field(default_factory=DeliveryPolicy)
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 100_000
    shutdown_grace_s: float = 10.0
    gzip_min_bytes: int = 512


ENGINE_KEY = web.AppKey("engine", Engine)
CONFIG_KEY = web.AppKey("config", ServerConfig)
METRICS_KEY = web.AppKey("metrics", Metrics)
ACTIVE_KEY = web.AppKey("active", ActiveReplies)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LAB_FORMAT = LabFormat()
NATIVE_FORMAT = NativeFormat()


def _int_query(request: web.Request, name: str, *, minimum: int) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise HTTPAPIError(
            400, f"{name} must be an integer, got {raw!r}", code="invalid_value", param=name
        ) from None
    if value < minimum:
        raise HTTPAPIError(
            400, f"{name} must be at least {minimum}", code="invalid_value", param=name
        )
    return value


def lab_request(request: web.Request) -> GenerationRequest:
    """The generation asked for by the lab endpoints' query string (prompt, seed, max_tokens)."""
    sampling = SamplingParams(
        seed=_int_query(request, "seed", minimum=0),
        max_tokens=_int_query(request, "max_tokens", minimum=1),
    )
    return GenerationRequest(prompt=request.query.get("prompt", ""), sampling=sampling)


async def start_generation(
    request: web.Request, generation: GenerationRequest, record: ReplyRecord
) -> DeltaStream:
    """Admit a request, turning engine refusals into API errors sent before any byte."""
    app = request.app
    try:
        deltas = await app[ENGINE_KEY].start(generation)
    except (RequestRejected, EngineError) as exc:
        record.outcome, record.reason = "rejected", exc.code
        app[METRICS_KEY].observe(record)
        if isinstance(exc, RequestRejected):
            raise HTTPAPIError(400, str(exc), code=exc.code, param=exc.param) from exc
        log.warning("generation failed before the first token: %s", exc)
        raise HTTPAPIError(500, str(exc), code=exc.code) from exc
    record.admitted_at = time.monotonic()
    return deltas


def _context(
    request: web.Request, record: ReplyRecord, policy: DeliveryPolicy, prompt: str
) -> ReplyContext:
    app = request.app
    return ReplyContext(
        policy=policy,
        metrics=app[METRICS_KEY],
        active=app[ACTIVE_KEY],
        record=record,
        prompt_tokens=app[ENGINE_KEY].count_tokens(prompt),
    )


def _moderated_body(text: str, violation: Violation) -> dict[str, Any]:
    return {"text": text, "finish_reason": "moderated", "moderation": moderated_payload(violation)}


async def handle_wait(request: web.Request) -> web.StreamResponse:
    """Buffered delivery: collect the whole reply, then send ``{"text": ...}`` once."""
    record = ReplyRecord("/wait", streamed=False)
    generation = lab_request(request)
    policy = request.app[CONFIG_KEY].policy
    deltas = await start_generation(request, generation, record)
    ctx = _context(request, record, policy, generation.prompt)
    return await buffered_reply(
        deltas, ctx, lambda text, _reason, _usage: {"text": text}, _moderated_body
    )


async def handle_stream(request: web.Request) -> web.StreamResponse:
    """Streamed delivery: one event per token (a JSON string), then ``data: [DONE]``."""
    record = ReplyRecord("/stream", streamed=True)
    generation = lab_request(request)
    policy = request.app[CONFIG_KEY].policy
    deltas = await start_generation(request, generation, record)
    ctx = _context(request, record, policy, generation.prompt)
    return await stream_reply(request, deltas, LAB_FORMAT, ctx)


def _native_body(text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
    return {"text": text, "finish_reason": finish_reason, "usage": usage.as_dict()}


async def handle_replies(request: web.Request) -> web.StreamResponse:
    """``POST /v1/replies``: a reply streamed as named events, or one JSON body."""
    config = request.app[CONFIG_KEY]
    body = await read_json_object(request)
    try:
        reply = parse_reply_request(body, config.policy, config.max_prompt_chars)
    except ValueError as exc:  # a policy value the field checks let through
        raise HTTPAPIError(400, str(exc), code="invalid_value") from exc
    record = ReplyRecord("/v1/replies", streamed=reply.stream)
    deltas = await start_generation(request, reply.generation, record)
    ctx = _context(request, record, reply.policy, reply.generation.prompt)
    if reply.stream:
        return await stream_reply(request, deltas, NATIVE_FORMAT, ctx)
    return await buffered_reply(deltas, ctx, _native_body, _moderated_body)


async def handle_metrics(request: web.Request) -> web.StreamResponse:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def handle_health(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok", "engine": request.app[ENGINE_KEY].name})


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every failure in the API's JSON error shape; never leak a stack trace."""
    try:
        return await handler(request)
    except HTTPAPIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG_KEY].max_body_bytes
        return error_response(
            413, f"request body is larger than {limit} bytes", code="body_too_large"
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal server error", code="internal_error")


@web.middleware
async def compress_documents(request: web.Request, handler: Handler) -> web.StreamResponse:
    """gzip JSON and HTML bodies for clients that accept it; never an event stream.

    Runs on the finished ``web.Response`` before it is sent; a stream is already on the wire
    by the time its handler returns, and is never touched.
    """
    response = await handler(request)
    if (
        isinstance(response, web.Response)
        and not response.prepared
        and response.content_type in ("application/json", "text/html")
        and isinstance(response.body, bytes)
        and len(response.body) >= request.app[CONFIG_KEY].gzip_min_bytes
        and "gzip" in request.headers.get("Accept-Encoding", "")
    ):
        response.enable_compression(web.ContentCoding.gzip)
    return response


def create_app(engine: Engine, config: ServerConfig | None = None) -> web.Application:
    """The replystream application serving ``engine``."""
    config = config or ServerConfig()
    app = web.Application(
        middlewares=[compress_documents, api_errors], client_max_size=config.max_body_bytes
    )
    app[ENGINE_KEY] = engine
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = Metrics()
    app[ACTIVE_KEY] = ActiveReplies()
    app.router.add_get("/wait", handle_wait)
    app.router.add_get("/stream", handle_stream)
    app.router.add_post("/v1/replies", handle_replies)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_health)

    async def close_engine(app: web.Application) -> None:
        await app[ENGINE_KEY].aclose()

    app.on_cleanup.append(close_engine)
    return app
