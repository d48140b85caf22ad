"""``POST /v1/responses``: the OpenAI Responses API, streamed or whole.

A streamed response is an ordinary reply (``start_reply`` + ``follow_reply``) in the
Responses dialect (``delivery.responses_format``), so batching, hold-back moderation,
keep-alive, the slow-client limits and cancellation hold as on every route; a stored
response (``store``, the API's default) is resumable, and its ``X-Reply-Id`` names it for
``GET /v1/replies/{id}/stream`` (``Last-Event-ID`` is its sequence numbers' cursor) and
``.../cancel``. ``stream: false`` collects it whole (``context.buffered``). The request's
``input`` (a string, or message items) and ``instructions`` become the same chat messages the
chat route passes on. This file turns requests into replies; it must not know how tokens
are made or how events are framed.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from replystream.delivery.formats import Usage, moderated_payload
from replystream.delivery.moderation import Violation
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.responses_format import (
    ResponseSettings,
    ResponsesStreamFormat,
    response_object,
)
from replystream.engine.base import GenerationRequest
from replystream.server import ids
from replystream.server.context import CONFIG_KEY, buffered, follow_reply, start_reply
from replystream.server.native import bad, delivery_overrides, sampling_params
from replystream.server.openai_api import SDK_KEEPALIVE, served_model
from replystream.server.openai_requests import model_not_found
from replystream.server.schemas import ResponsesBody, SamplingFields
from replystream.server.validation import read_model


def chat_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """``instructions`` (as a system message) then ``input``, as chat messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages.extend({"role": m.role, "content": m.text} for m in body.input)
    return messages


def _sampling(body: ResponsesBody) -> SamplingFields:
    """The sampling and delivery fields, the API's own and replystream's extensions."""
    extensions = body.replystream
    return SamplingFields(
        temperature=body.temperature,
        top_p=body.top_p,
        **({} if extensions is None else extensions.model_dump(exclude_none=True)),
    )


def _generation(body: ResponsesBody, max_prompt_chars: int) -> GenerationRequest:
    messages = chat_messages(body)
    prompt = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    if len(prompt) > max_prompt_chars:
        raise bad(
            "input",
            f"the input is {len(prompt)} characters; this server's limit is {max_prompt_chars}",
            "context_length_exceeded",
        )
    return GenerationRequest(
        prompt, sampling_params(_sampling(body), body.max_output_tokens), tuple(messages)
    )


async def handle_responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: a response streamed as typed events, or one object."""
    app = request.app
    config = app[CONFIG_KEY]
    body = await read_model(request, ResponsesBody)
    model = served_model(app)
    if body.model is not None and body.model != model:
        raise model_not_found(body.model)
    generation = _generation(body, config.max_prompt_chars)
    policy = delivery_overrides(_sampling(body), config.policy)
    settings = ResponseSettings(
        model=model,
        created_at=int(time.time()),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        metadata=body.metadata,
        store=body.store,
    )
    if not body.stream:
        return await _whole(request, generation, settings, policy)
    reply = await start_reply(
        request,
        generation,
        endpoint="/v1/responses",
        fmt=ResponsesStreamFormat(settings),
        policy=policy,
        resumable=body.store,  # a stored response can be read again, on any replica
    )
    return follow_reply(
        request,
        reply_id=reply.reply_id,
        store=reply.store,
        policy=policy,
        reply=reply,
        keepalive=SDK_KEEPALIVE,
    )


async def _whole(
    request: web.Request,
    generation: GenerationRequest,
    settings: ResponseSettings,
    policy: DeliveryPolicy,
) -> web.StreamResponse:
    reply_id = ids.reply_id()

    def body(text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        if finish_reason == "length":
            return response_object(
                settings,
                reply_id,
                "incomplete",
                text=text,
                usage=usage,
                incomplete_reason="max_output_tokens",
            )
        return response_object(settings, reply_id, "completed", text=text, usage=usage)

    def moderated(text: str, violation: Violation) -> dict[str, Any]:
        response = response_object(
            settings, reply_id, "incomplete", text=text, incomplete_reason="content_filter"
        )
        response["replystream_moderation"] = moderated_payload(violation)
        return response

    response = await buffered(
        request,
        generation,
        endpoint="/v1/responses",
        policy=policy,
        body=body,
        moderated_body=moderated,
    )
    response.headers["X-Reply-Id"] = reply_id
    return response


def add_responses_routes(app: web.Application) -> None:
    """Register the Responses API on ``app``."""
    app.router.add_post("/v1/responses", handle_responses)
