"""HTTP routes and the application factory.

Routes:
- ``GET /wait`` and ``GET /stream``: the lab's two deliveries of the same generation (a JSON
  body ``{"text": ...}``, or one ``data: "<token>"`` event per token then ``data: [DONE]``);
  query parameters ``prompt``, ``seed``, ``max_tokens``, ``resumable=1``, and ``ids=0`` for
  the reference article's exact framing (no event ids, no ``reply`` event).
- ``POST /v1/replies``: the native endpoint (named events, delivery policies, ``stream``,
  ``resumable``).
- ``GET /v1/replies/{id}/stream``: resume a reply after ``Last-Event-ID`` (header) or
  ``last_event_id`` (query), kept alive as its request asked (or as ``keepalive_s``, query,
  asks); ``POST /v1/replies/{id}/cancel``: stop it.
- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``: the
  OpenAI-compatible API (``server.openai_api``).
- ``GET /v1/ws``: the same replies over a WebSocket, several at once (``server.websocket``).
- ``GET /metrics`` (Prometheus text format) and ``GET /healthz``.
Every ``/v1/*`` route needs an API key once keys are configured (``server.auth``).
A streamed reply is produced into its reply log under the ``ReplyManager`` and read from the
log by the connection (a ``delivery.follower`` writing through the SSE frame transport);
buffered replies are collected whole (``server.buffered``). This file turns requests into
those; it must not know how tokens are made.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from replystream.delivery.follower import ResumePlace
from replystream.delivery.formats import moderated_payload
from replystream.delivery.keepalive_clock import KeepaliveClock
from replystream.delivery.moderation import Violation
from replystream.delivery.replay import (
    MemoryReplayStore,
    ReplayStore,
    StoreUnavailable,
)
from replystream.engine.base import (
    Engine,
    GenerationRequest,
    SamplingParams,
)
from replystream.server.anthropic_api import add_anthropic_routes
from replystream.server.auth import KEY_RING, KeyRing, api_key_check
from replystream.server.browser_guard import stamp_response
from replystream.server.buffered import Whole
from replystream.server.cancels import cancel
from replystream.server.context import (
    CONFIG_KEY,
    ENGINE_KEY,
    KEEPALIVE_CLOCK_KEY,
    LAB_FORMAT,
    LOCAL_STORE_KEY,
    MANAGER_KEY,
    METRICS_KEY,
    NATIVE_FORMAT,
    SERVER_STOPS_KEY,
    STORE_KEY,
    buffered,
    caller_of,
    follow_started,
    start_reply,
)
from replystream.server.embeddings_api import add_embeddings_route
from replystream.server.errors import HTTPAPIError, retry_after_value
from replystream.server.front_door import FrontDoor, add_unrouted, expect_later, front_door
from replystream.server.guard import BODY_ROOM_KEY, GATE_KEY, GUARD_KEY, BodyRoom, ClientGate
from replystream.server.metrics import Metrics
from replystream.server.native import parse_reply_request
from replystream.server.native_schemas import ReplyBody
from replystream.server.openai_api import add_openai_routes, routed_model
from replystream.server.pages import add_page_routes
from replystream.server.query_schemas import LabQuery, ResumeCursor
from replystream.server.refusal_names import refusals_naming
from replystream.server.replies import ReplyManager
from replystream.server.responses_api import add_responses_routes
from replystream.server.responses_input_items import add_input_items_route
from replystream.server.responses_input_tokens import add_input_tokens_route
from replystream.server.resume_dialects import follow_resumed
from replystream.server.resume_points import (
    NO_SUCH_REPLY,
    check_resume_point,
    find_reply,
    resume_after,
)
from replystream.server.server_config import ServerConfig
from replystream.server.state import add_state_gauges
from replystream.server.validation import parse_mapping, read_model
from replystream.server.websocket import add_websocket_route

log = logging.getLogger("replystream.server")
# What /healthz says to wait when the engine cannot tell when it will be ready.
UNREADY_RETRY_S = 5.0


def lab_query(request: web.Request) -> LabQuery:
    """The lab endpoints' query parameters, validated (each given once at most)."""
    return parse_mapping(request.query, LabQuery)


def lab_request(request: web.Request, query: LabQuery) -> GenerationRequest:
    """The generation asked for by the lab endpoints' query string (prompt, seed, max_tokens)."""
    limit = request.app[CONFIG_KEY].max_prompt_chars
    if len(query.prompt) > limit:
        raise HTTPAPIError(
            400,
            f"prompt is {len(query.prompt)} characters; the limit is {limit}",
            code="prompt_too_long",
            param="prompt",
        )
    sampling = SamplingParams(seed=query.seed, max_tokens=query.max_tokens)
    return GenerationRequest(prompt=query.prompt, sampling=sampling, caller=caller_of(request))


def _lab_moderated_body(whole: Whole, violation: Violation) -> dict[str, Any]:
    moderation = moderated_payload(violation)
    return {**_lab_body(whole), "finish_reason": "moderated", "moderation": moderation}


def _native_moderated_body(whole: Whole, violation: Violation) -> dict[str, Any]:
    moderation = moderated_payload(violation)
    return {**_native_body(whole), "finish_reason": "moderated", "moderation": moderation}


def _native_body(whole: Whole) -> dict[str, Any]:
    body: dict[str, Any] = {"text": whole.text, "finish_reason": whole.finish_reason}
    if whole.reasoning:
        body["thinking"] = whole.reasoning
    if whole.tool_calls:
        body["tool_calls"] = [call.as_openai() for call in whole.tool_calls]
    body["usage"] = whole.usage.as_dict()
    if whole.stop_sequence is not None:
        body["stop_sequence"] = whole.stop_sequence
    return body


def _lab_body(whole: Whole) -> dict[str, Any]:
    if whole.tool_calls:  # a scripted engine's calls: kept beside the text, never dropped
        return {"text": whole.text, "tool_calls": [c.as_openai() for c in whole.tool_calls]}
    return {"text": whole.text}


async def handle_wait(request: web.Request) -> web.StreamResponse:
    """Buffered delivery: collect the whole reply, then send ``{"text": ...}`` once."""
    policy = request.app[CONFIG_KEY].policy
    query = lab_query(request)
    if query.resumable:  # a body sent whole has nothing to resume: say so, never ignore it
        raise HTTPAPIError(
            400,
            "resumable=1 applies to /stream; /wait sends its reply whole",
            code="invalid_value",
            param="resumable",
        )
    generation = lab_request(request, query)
    return await buffered(
        request,
        generation,
        endpoint="/wait",
        policy=policy,
        body=_lab_body,
        moderated_body=_lab_moderated_body,
    )


async def handle_stream(request: web.Request) -> web.StreamResponse:
    """Streamed delivery: one event per token (a JSON string), then ``data: [DONE]``."""
    config = request.app[CONFIG_KEY]
    query = lab_query(request)
    generation = lab_request(request, query)
    numbered = query.ids
    if query.resumable and not numbered:  # a resume starts after an event id: say so
        raise HTTPAPIError(
            400,
            "resumable=1 needs event ids to resume after, which ids=0 leaves out",
            code="invalid_value",
            param="resumable",
        )
    reply = await start_reply(
        request,
        generation,
        endpoint="/stream",
        fmt=LAB_FORMAT,
        policy=config.policy,
        resumable=query.resumable,
        numbered=numbered,
    )
    return follow_started(request, reply, config.policy, numbered=numbered)


async def handle_replies(request: web.Request) -> web.StreamResponse:
    """``POST /v1/replies``: a reply streamed as named events, or one JSON body."""
    config = request.app[CONFIG_KEY]
    body = await read_model(request, ReplyBody)
    ask = parse_reply_request(
        body,
        config.policy,
        config.max_prompt_chars,
        caller=caller_of(request),
        model=routed_model(request.app, body.model),
    )
    with refusals_naming(ask.fields):
        if not ask.stream:
            return await buffered(
                request,
                ask.generation,
                endpoint="/v1/replies",
                policy=ask.policy,
                body=_native_body,
                moderated_body=_native_moderated_body,
            )
        reply = await start_reply(
            request,
            ask.generation,
            endpoint="/v1/replies",
            fmt=NATIVE_FORMAT,
            policy=ask.policy,
            resumable=ask.resumable,
            disconnect=ask.disconnect,
            keepalive_s=body.keepalive_s,  # its resumes keep it too
        )
    return follow_started(request, reply, ask.policy)


async def handle_resume(request: web.Request) -> web.StreamResponse:
    """``GET /v1/replies/{id}/stream``: replay after ``Last-Event-ID``, then follow live,
    kept alive at the query's ``keepalive_s``, else at the reply's own."""
    query = parse_mapping(request.query, ResumeCursor)
    after, param = resume_after(request, {"last_event_id": query.last_event_id})
    reply_id, store, local, info = await find_reply(request, request.match_info["reply_id"])
    if after > 0:
        await check_resume_point(reply_id, store, after, made_here=local is not None, param=param)
    gone = HTTPAPIError(404, NO_SUCH_REPLY, code="reply_not_found", param="reply_id")
    return await follow_resumed(
        request,
        info,
        store,
        local,
        after,
        ResumePlace(param),
        keepalive_s=query.keepalive_s,
        gone=gone,
    )


async def handle_cancel(request: web.Request) -> web.StreamResponse:
    """``POST /v1/replies/{id}/cancel``: stop generating a reply (on whichever replica). A
    reply that has ended already, or whose own end the cancel met, is left as it ended, and
    the answer says no cancel was asked for (a client told ``true`` would take its reply for
    cancelled)."""
    reply_id, store, local, _ = await find_reply(request, request.match_info["reply_id"])
    try:
        # Answered once its ending is known: a reply whose end met the cancel ended as it
        # would have, and is told so.
        stopped = await cancel(store, reply_id, local)
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    return web.json_response({"reply_id": reply_id, "cancel_requested": stopped})


async def handle_metrics(request: web.Request) -> web.StreamResponse:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def handle_health(request: web.Request) -> web.StreamResponse:
    """``200 {"status": "ok"}`` while the engine can serve; ``503 {"status": "unavailable",
    "reason": ...}`` while it cannot (a relay whose upstream does not answer), so a load
    balancer sends requests elsewhere instead of to certain 502s; ``503`` too from the
    moment shutdown begins, when every new reply is refused.

    A worker of ``--workers`` stopping alone (sent SIGTERM by itself; the others serve the
    port on) does not speak for the server with that 503: a balancer checking the port over
    a kept-alive connection that landed on it would take the whole server out. It answers
    as a serving worker would, and closes the connection, so the next check makes a new one,
    which the kernel gives to a worker still listening."""
    app = request.app
    if not app[MANAGER_KEY].accepting:
        server_stops = app.get(SERVER_STOPS_KEY)
        if server_stops is None or server_stops():
            body = {"status": "unavailable", "engine": app[ENGINE_KEY].name}
            return web.json_response({**body, "reason": "shutting down"}, status=503)
        response = await engine_health(app[ENGINE_KEY])
        response.force_close()
        return response
    return await engine_health(app[ENGINE_KEY])


async def engine_health(engine: Engine) -> web.Response:
    """``/healthz``'s answer from what the engine says of itself."""
    readiness = await engine.readiness()
    if readiness.ready:
        return web.json_response({"status": "ok", "engine": engine.name})
    body = {"status": "unavailable", "engine": engine.name, "reason": readiness.reason}
    wait_s = UNREADY_RETRY_S if readiness.retry_after_s is None else readiness.retry_after_s
    return web.json_response(body, status=503, headers={"Retry-After": retry_after_value(wait_s)})


async def report_readiness(app: web.Application) -> None:
    """At start-up: say at once when the engine cannot serve yet (its first check)."""
    readiness = await app[ENGINE_KEY].readiness()
    if not readiness.ready:
        log.warning("the engine is not ready: %s; /healthz answers 503", readiness.reason)


def create_app(
    engine: Engine, config: ServerConfig | None = None, store: ReplayStore | None = None
) -> web.Application:
    """The replystream application serving ``engine``; resumable replies go to ``store``
    (default: this process's memory)."""
    config = config or ServerConfig()
    guard = config.guard
    ring = KeyRing(config.api_keys) if config.api_keys else None
    door = FrontDoor(
        cors_origins=guard.cors_origins,
        allowed_hosts=guard.allowed_hosts,
        gate=ClientGate(guard.max_concurrent, guard.per_minute),
        check_key=None if ring is None else api_key_check(ring),
        max_body_bytes=config.max_body_bytes,
        gzip_min_bytes=config.gzip_min_bytes,
    )
    app = web.Application(middlewares=[front_door(door)], client_max_size=config.max_body_bytes)
    app[GUARD_KEY] = guard
    app[BODY_ROOM_KEY] = BodyRoom(guard.max_reading_bytes)
    app[GATE_KEY] = door.gate
    if ring is not None:
        app[KEY_RING] = ring
    app.on_response_prepare.append(stamp_response)
    local_store = MemoryReplayStore()
    metrics = Metrics()
    app[ENGINE_KEY] = engine
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = metrics
    app[MANAGER_KEY] = ReplyManager(metrics)
    app[KEEPALIVE_CLOCK_KEY] = KeepaliveClock()
    app[LOCAL_STORE_KEY] = local_store
    app[STORE_KEY] = store if store is not None else local_store

    def stop_producer(reply_id: str) -> None:
        """A cancel requested for a reply made here (asked on any replica) stops it."""
        reply = app[MANAGER_KEY].get(reply_id)
        if reply is not None:
            reply.stop("cancelled")

    def lost_producer(reply_id: str) -> None:
        """A reply made here that a reader elsewhere found lost (this process stalled past
        its liveness) ends as its readers there were told."""
        reply = app[MANAGER_KEY].get(reply_id)
        if reply is not None:
            reply.stop("taken_for_lost")

    local_store.on_cancel(stop_producer)
    if store is not None:
        store.on_cancel(stop_producer)
        store.on_lost(lost_producer)
    # A HEAD of a route that generates or streams would start a generation and, on the direct
    # path, write a body no HEAD may have: such routes answer HEAD with 405 (docs/api.md).
    app.router.add_get("/wait", handle_wait, allow_head=False, expect_handler=expect_later)
    app.router.add_get("/stream", handle_stream, allow_head=False, expect_handler=expect_later)
    app.router.add_post("/v1/replies", handle_replies, expect_handler=expect_later)
    app.router.add_get(
        "/v1/replies/{reply_id}/stream",
        handle_resume,
        allow_head=False,
        expect_handler=expect_later,
    )
    app.router.add_post("/v1/replies/{reply_id}/cancel", handle_cancel, expect_handler=expect_later)
    app.router.add_get("/metrics", handle_metrics, expect_handler=expect_later)
    app.router.add_get("/healthz", handle_health, expect_handler=expect_later)
    add_page_routes(app, config.policy)
    add_openai_routes(app)
    add_embeddings_route(app)
    add_responses_routes(app)
    add_input_items_route(app)
    add_input_tokens_route(app)
    add_anthropic_routes(app)
    add_websocket_route(app)
    add_state_gauges(app)
    add_unrouted(app.router)  # last: whatever no route above serves

    async def close_all(app: web.Application) -> None:
        await app[MANAGER_KEY].aclose()
        app[KEEPALIVE_CLOCK_KEY].close()
        app[GATE_KEY].close()
        await app[ENGINE_KEY].aclose()
        if app[STORE_KEY] is not app[LOCAL_STORE_KEY]:
            await app[STORE_KEY].aclose()
        await app[LOCAL_STORE_KEY].aclose()

    app.on_startup.append(report_readiness)
    app.on_cleanup.append(close_all)
    return app
