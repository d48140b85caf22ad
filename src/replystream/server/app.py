"""HTTP routes and the application factory.

This file decides how one generation is delivered over HTTP: buffered as one JSON body
(``GET /wait``) or streamed as server-sent events (``GET /stream``). It owns the request's task:
aiohttp cancels the handler when the client goes away (``handler_cancellation=True`` in
``serve``), and every handler closes its delta stream in ``finally``, so a reader that leaves
stops generation in both modes.
It must not know how tokens are made (that is the engine's job).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from replystream.engine.base import (
    DeltaStream,
    Engine,
    EngineError,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
)
from replystream.server.errors import HTTPAPIError, error_response
from replystream.sse import Event, encode

log = logging.getLogger("replystream.server")

ENGINE_KEY = web.AppKey("engine", Engine)

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Asks nginx (and proxies that honour it) not to hold this response in a buffer.
    "X-Accel-Buffering": "no",
}
DONE_FRAME = b"data: [DONE]\n\n"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


async def start_generation(engine: Engine, request: GenerationRequest) -> DeltaStream:
    """Admit a request, turning engine refusals into API errors sent before any byte."""
    try:
        return await engine.start(request)
    except RequestRejected as exc:
        raise HTTPAPIError(400, str(exc), code=exc.code, param=exc.param) from exc
    except EngineError as exc:
        log.warning("generation failed before the first token: %s", exc)
        raise HTTPAPIError(500, str(exc), code=exc.code) from exc


def error_event(message: str, code: str) -> bytes:
    """An in-band error for a stream whose status line is already sent."""
    payload = json.dumps({"error": {"message": message, "code": code}})
    return encode(Event(payload, type="error"))


async def handle_wait(request: web.Request) -> web.StreamResponse:
    """Buffered delivery: collect the whole reply, then send ``{"text": ...}`` once."""
    deltas = await start_generation(request.app[ENGINE_KEY], lab_request(request))
    parts: list[str] = []
    try:
        async for delta in deltas:
            parts.append(delta.text)
    except EngineError as exc:
        log.warning("generation failed: %s", exc)
        raise HTTPAPIError(500, str(exc), code=exc.code) from exc
    finally:
        await deltas.aclose()
    body = json.dumps({"text": "".join(parts)}, separators=(",", ":"))
    return web.Response(text=body, content_type="application/json")


async def handle_stream(request: web.Request) -> web.StreamResponse:
    """Streamed delivery: one event per token (a JSON string), then ``data: [DONE]``."""
    deltas = await start_generation(request.app[ENGINE_KEY], lab_request(request))
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        # Headers leave now, before the first token exists.
        await response.prepare(request)
        try:
            async for delta in deltas:
                if delta.text:
                    await response.write(encode(Event(json.dumps(delta.text))))
        except EngineError as exc:
            log.warning("generation failed mid-stream: %s", exc)
            await response.write(error_event(str(exc), exc.code))
        else:
            await response.write(DONE_FRAME)
        await response.write_eof()
    except ConnectionError:
        # The client left while we were writing; the finally below stops generation.
        log.info("client left %s", request.path)
    finally:
        await deltas.aclose()
    return response


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every failure in the API's JSON error shape; never leak a stack trace."""
    try:
        return await handler(request)
    except HTTPAPIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal server error", code="internal_error")


async def handle_health(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok", "engine": request.app[ENGINE_KEY].name})


def create_app(engine: Engine) -> web.Application:
    """The replystream application serving ``engine``."""
    app = web.Application(middlewares=[api_errors])
    app[ENGINE_KEY] = engine
    app.router.add_get("/wait", handle_wait)
    app.router.add_get("/stream", handle_stream)
    app.router.add_get("/healthz", handle_health)

    async def close_engine(app: web.Application) -> None:
        await app[ENGINE_KEY].aclose()

    app.on_cleanup.append(close_engine)
    return app
