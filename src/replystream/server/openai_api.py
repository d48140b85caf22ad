"""The OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A streamed completion is an ordinary reply (``start_reply`` + ``follow_started``) in the OpenAI
dialect (``delivery.openai_formats``), so batching, hold-back moderation, keep-alive,
slow-client limits, cancellation and resume all apply; its ``X-Reply-Id`` header and chunk id
(``chatcmpl-<reply id>``) name it for ``GET /v1/replies/{id}/stream`` and ``.../cancel``.
A reply with ``stream: false`` is collected whole (``buffered_reply``). This file turns
requests into replies; it must not know how tokens are made or how events are framed.
Models: an engine that routes by model (a relay: its upstreams' own names, merged, and a
routes file's aliases) lists them in ``GET /v1/models``, and a request's ``model`` picks the
upstreams serving it; the server's own name (``--model-name``, else the engine's) is always
accepted and means "any". Any other name is a 404 ``model_not_found``, but for a relay with an
upstream whose models are not known: it is sent the name, as named. An Anthropic client
(``anthropic-version``) is answered in its API's shape (``server.anthropic_models``).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from replystream.delivery.formats import Usage, moderated_payload
from replystream.delivery.moderation import Violation
from replystream.delivery.openai_formats import (
    DIALECT,
    MODERATED_FINISH,
    MODERATION_FIELD,
    Kind,
    OpenAIStreamFormat,
    ReaderNotices,
    completion_body,
    completion_choice,
)
from replystream.server import ids
from replystream.server.anthropic_models import model_info, model_page
from replystream.server.buffered import Whole
from replystream.server.context import (
    CONFIG_KEY,
    ENGINE_KEY,
    Choices,
    buffered,
    caller_of,
    follow_started,
    start_reply,
)
from replystream.server.errors import speaks_anthropic
from replystream.server.front_door import expect_later
from replystream.server.openai_requests import (
    CompletionAsk,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
)
from replystream.server.openai_schemas import ChatBody, CompletionBody
from replystream.server.query_schemas import AnthropicModelsQuery
from replystream.server.refusal_names import refusals_naming
from replystream.server.validation import parse_mapping, read_model

# A comment line without the blank line after it: the OpenAI Python SDK turns a blank line
# after a comment into an empty event once it has seen an ``id:``, and fails to parse it.
SDK_KEEPALIVE = b": keep-alive\n"
STARTED_AT = web.AppKey("openai_started_at", int)


def served_model(app: web.Application) -> str:
    """The model a request that names none is served as: ``--model-name``; else the engine's
    own default (``--upstream-model``); else, for an engine that lists models (a relay: its
    upstreams'), the first it lists (its default), so
    a reply's ``model`` is one ``GET /v1/models`` shows and the request goes where that model
    is served; else the engine's own name."""
    return _default_model(app, app[ENGINE_KEY].model_names())


def _default_model(app: web.Application, names: tuple[str, ...]) -> str:
    engine = app[ENGINE_KEY]
    return (
        app[CONFIG_KEY].model_name or engine.default_model() or (names[0] if names else engine.name)
    )


def listed_models(app: web.Application) -> list[str]:
    """What ``GET /v1/models`` lists: the engine's own model names (``--model-name`` first
    when given), or else the one name the server answers to."""
    names = list(app[ENGINE_KEY].model_names())
    named = app[CONFIG_KEY].model_name
    if not names:
        return [served_model(app)]
    return [named, *(n for n in names if n != named)] if named else names


def routed_model(app: web.Application, asked: str | None) -> str | None:
    """The model a request routes by: a name the engine serves; for none, the one it is
    served as (``served_model``) when the engine serves a model of that name; else None (any
    will do) for none or the server's own name; any other name as given, to an engine that
    passes names it does not list on (a relay with upstreams whose models are not known).

    Raises:
        HTTPAPIError: 404 ``model_not_found`` for any other name.
    """
    engine = app[ENGINE_KEY]
    names = engine.model_names()
    default = _default_model(app, names)
    name = default if asked is None else asked
    if name in names:  # a model (or alias) of that name: its route
        return name
    if name == default:
        return None
    if engine.passes_unlisted_models():
        return name
    raise model_not_found(name)


def _model_object(app: web.Application, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": app[STARTED_AT],
        "owned_by": "replystream",
    }


async def handle_models(request: web.Request) -> web.StreamResponse:
    """``GET /v1/models``: every model served (to an Anthropic client, a page of them in
    its API's shape)."""
    names = listed_models(request.app)
    if speaks_anthropic(request.path, request.headers):
        query = parse_mapping(request.query, AnthropicModelsQuery)
        return web.json_response(model_page(names, request.app[STARTED_AT], query))
    data = [_model_object(request.app, name) for name in names]
    return web.json_response({"object": "list", "data": data})


async def handle_model(request: web.Request) -> web.StreamResponse:
    """``GET /v1/models/{model}``: that model, or 404 ``model_not_found``."""
    name = request.match_info["model"]
    if name not in listed_models(request.app):
        raise model_not_found(name)
    if speaks_anthropic(request.path, request.headers):
        return web.json_response(model_info(name, request.app[STARTED_AT]))
    return web.json_response(_model_object(request.app, name))


async def _buffered(
    request: web.Request, kind: Kind, ask: CompletionAsk, model: str, created: int
) -> web.StreamResponse:
    reply_id = ids.reply_id()

    def body(whole: Whole) -> dict[str, Any]:
        return completion_body(
            kind,
            reply_id=reply_id,
            model=model,
            created=created,
            text=whole.text,
            finish_reason=whole.finish_reason,
            usage=whole.usage,
            logprobs=whole.logprobs,
            tool_calls=whole.tool_calls,
            reasoning=whole.reasoning,
            text_offset_from=ask.text_offset_from,
            refusal=whole.refused,
        )

    def moderated(whole: Whole, violation: Violation) -> dict[str, Any]:
        return completion_body(
            kind,
            reply_id=reply_id,
            model=model,
            created=created,
            text=whole.text,
            finish_reason=MODERATED_FINISH,
            usage=whole.usage,
            moderation=moderated_payload(violation),
            logprobs=whole.logprobs,
            tool_calls=whole.tool_calls,
            reasoning=whole.reasoning,
            text_offset_from=ask.text_offset_from,
            refusal=whole.refused,
        )

    def several(wholes: list[Whole]) -> dict[str, Any]:
        choices = []
        for index, whole in enumerate(wholes):
            finish = whole.finish_reason if whole.violation is None else MODERATED_FINISH
            logprobs, calls = whole.logprobs, whole.tool_calls
            choice = completion_choice(
                kind,
                index,
                whole.text,
                finish,
                logprobs,
                calls,
                whole.reasoning,
                ask.text_offset_from,
                whole.refused,
            )
            if whole.violation is not None:
                choice[MODERATION_FIELD] = moderated_payload(whole.violation)
            choices.append(choice)
        prompt = wholes[0].usage  # counted once, as OpenAI does
        usage = Usage(
            prompt.prompt_tokens,
            sum(whole.usage.completion_tokens for whole in wholes),
            sum(whole.usage.reasoning_tokens for whole in wholes),
            prompt.cached_prompt_tokens,
        )
        return completion_body(
            kind, reply_id=reply_id, model=model, created=created, usage=usage, choices=choices
        )

    return await buffered(
        request,
        ask.generation,
        endpoint=request.path,
        policy=ask.policy,
        body=body,
        moderated_body=moderated,
        reply_id=reply_id,
        choices=None if ask.n == 1 else (ask.n, several),
    )


async def _complete(
    request: web.Request, kind: Kind, ask: CompletionAsk, model: str
) -> web.StreamResponse:
    """Start a completion: its chunks streamed, or one JSON body (a refusal naming the
    fields as the client sent them)."""
    created = int(time.time())
    with refusals_naming(ask.fields):
        if not ask.stream:
            return await _buffered(request, kind, ask, model, created)
        policy = ask.policy
        offset = ask.text_offset_from  # every choice's text_offset counts from the prompt
        fmt: OpenAIStreamFormat | Choices = OpenAIStreamFormat(
            kind, model, created, ask.include_usage, text_offset_from=offset
        )
        if ask.n > 1:  # one format per choice; the usage chunk and [DONE] once, at the end
            formats = [
                OpenAIStreamFormat(
                    kind,
                    model,
                    created,
                    ask.include_usage,
                    i,
                    one_of_many=True,
                    text_offset_from=offset,
                )
                for i in range(ask.n)
            ]
            fmt = Choices(formats, formats[0].reply_end)
        reply = await start_reply(
            request,
            ask.generation,
            endpoint=request.path,
            fmt=fmt,
            policy=policy,
            resumable=ask.resumable,
            # A resume finding nothing kept to tell the dialect by (a reply nobody may resume
            # drops what its reader sent) still speaks it.
            dialect=DIALECT,
            keepalive_s=ask.keepalive_s,  # its resumes keep it too
        )
    return follow_started(request, reply, policy, keepalive=SDK_KEEPALIVE, notices=ReaderNotices())


async def handle_chat(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``: a ``chat.completion``, or its chunks streamed."""
    body = await read_model(request, ChatBody)
    config, routed = request.app[CONFIG_KEY], routed_model(request.app, body.model)
    ask = parse_chat_request(
        body,
        model=routed,
        defaults=config.policy,
        max_prompt_chars=config.max_prompt_chars,
        caller=caller_of(request),
    )
    return await _complete(request, "chat", ask, routed or served_model(request.app))


async def handle_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``: a legacy ``text_completion``, or its chunks streamed."""
    body = await read_model(request, CompletionBody)
    config, routed = request.app[CONFIG_KEY], routed_model(request.app, body.model)
    ask = parse_completion_request(
        body,
        model=routed,
        defaults=config.policy,
        max_prompt_chars=config.max_prompt_chars,
        caller=caller_of(request),
    )
    return await _complete(request, "text", ask, routed or served_model(request.app))


def add_openai_routes(app: web.Application) -> None:
    """Register the OpenAI-compatible routes on ``app``."""
    app[STARTED_AT] = int(time.time())
    app.router.add_post("/v1/chat/completions", handle_chat, expect_handler=expect_later)
    app.router.add_post("/v1/completions", handle_completions, expect_handler=expect_later)
    app.router.add_get("/v1/models", handle_models, expect_handler=expect_later)
    # A model id may hold a slash (a Hugging Face name, org/model): the rest of the path.
    app.router.add_get("/v1/models/{model:.+}", handle_model, expect_handler=expect_later)
