"""``POST /v1/messages``: Anthropic's Messages API, streamed or whole; and
``POST /v1/messages/count_tokens``, the prompt's size the same message would report.

A streamed message is an ordinary reply (``start_reply`` + ``follow_started``) in the Anthropic
dialect (``delivery.anthropic_format``), so batching, hold-back moderation, the slow-client
limits and cancellation hold as on every route; its keep-alive is Anthropic's ``ping`` event,
and its events keep our ids, so ``GET /v1/replies/{id}/stream`` resumes it after any of them
(``X-Reply-Id`` names it). ``stream: false`` collects it whole. ``system`` and ``messages``
become the same chat messages the other routes pass on; ``anthropic-version`` is accepted
whatever it says (this route follows the current version). Errors are in Anthropic's shape
(``errors.in_route_shape``). A count is the engine's count of the prompt a message of the
same input would have (``_conversation`` makes both), so it equals that message's
``message_start`` ``input_tokens``; it starts no reply. This file turns requests into
replies; it must not know how tokens are made or how events are framed.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial
from typing import Any

from aiohttp import web

from replystream.delivery.anthropic_format import (
    DIALECT,
    PING,
    AnthropicStreamFormat,
    ReaderNotices,
    message_object,
    stop_reason_of,
)
from replystream.delivery.formats import moderated_payload
from replystream.delivery.moderation import Violation
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Engine, GenerationRequest, RequestRejected
from replystream.server import ids
from replystream.server.anthropic_schemas import AnthropicOutputConfig, MessagesBody, MessagesInput
from replystream.server.buffered import Whole
from replystream.server.context import (
    CONFIG_KEY,
    ENGINE_KEY,
    buffered,
    caller_of,
    count_prompt,
    follow_started,
    start_reply,
)
from replystream.server.errors import HTTPAPIError
from replystream.server.front_door import expect_later
from replystream.server.native import (
    check_prompt_size,
    delivery_overrides,
    sampling_params,
)
from replystream.server.openai_api import routed_model, served_model
from replystream.server.output_formats import engine_format
from replystream.server.refusal_names import FieldNames, refusals_naming
from replystream.server.schema_fields import SamplingFields
from replystream.server.tool_requests import (
    Origin,
    anthropic_messages,
    anthropic_tools,
    check_anthropic_turns,
    check_tool_answers,
    one_message_a_turn,
    prompt_of,
)
from replystream.server.validation import read_model

# A Messages client sent the prompt as ``messages`` (whose final assistant message, a
# prefill, is what is continued), disables parallel calls in its ``tool_choice``, and has no
# seed but ``replystream``'s. Its ``top_k`` and ``stop_sequences`` may be ``replystream``'s
# instead: an upstream naming either is left out.
_OURS = {
    "continue_final_message": "messages",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}
_AS_SENT = ("messages", "max_tokens", "temperature", "top_p", "tools", "tool_choice")
# Fields only ``replystream`` has (an engine refusing one names it as its own).
_EXTENSIONS = {
    name: f"replystream.{name}" for name in ("seed", "min_p", "min_tokens", "ignore_eos")
}
_FIELDS = FieldNames(
    {"prompt": "messages", "response_format": "output_config.format", **_OURS, **_EXTENSIONS},
    {
        **{name: name for name in _AS_SENT},
        **_OURS,
        "add_generation_prompt": "messages",  # sent (false) with a prefill to continue
        "max_completion_tokens": "max_tokens",
        **_EXTENSIONS,
        "reasoning_effort": "output_config.effort",
        "response_format": "output_config.format",
        "user": "metadata.user_id",
    },
)


def _sampling(body: MessagesBody) -> SamplingFields:
    extensions = body.replystream
    fields: dict[str, Any] = {} if extensions is None else extensions.model_dump(exclude_none=True)
    if body.stop_sequences:
        fields["stop"] = tuple(body.stop_sequences)
    if body.top_k is not None:
        fields["top_k"] = body.top_k
    # Validated already (``MessagesBody``): put together, not checked again.
    return SamplingFields.model_construct(temperature=body.temperature, top_p=body.top_p, **fields)


def _conversation(request: web.Request, body: MessagesInput) -> GenerationRequest:
    """The request a message's input makes, checked as a message is (its tool results, the
    prompt limit, the model): the prompt and all an engine builds it from, with no sampling.
    A message and its count (``count_tokens``) are both made here, so the count is the
    prompt the message would have."""
    app = request.app
    model = routed_model(app, body.model)
    messages: list[dict[str, Any]] = []
    origins: list[Origin] = []
    if body.system_text:
        messages.append({"role": "system", "content": body.system_text})
        origins.append(Origin("system"))
    converted, their_origins = anthropic_messages(body.messages)
    messages += converted
    check_tool_answers(messages, [*origins, *their_origins])
    check_anthropic_turns(body.messages)
    # Checked as sent (each error names a message the client wrote); then one turn each.
    messages = one_message_a_turn(messages)
    tools, tool_choice = anthropic_tools(body.tools, body.tool_choice)
    prompt = prompt_of(messages)
    check_prompt_size(prompt, app[CONFIG_KEY].max_prompt_chars, "messages")
    choice = body.tool_choice
    disabled = None if choice is None else choice.disable_parallel_tool_use
    parallel = None if disabled is None else not disabled
    # Anthropic's prefill: a final assistant turn (text, no tool call) is the start of the
    # reply, which goes on from it (as chat's ``continue_final_message``).
    last = messages[-1] if messages else None
    prefill = last is not None and last["role"] == "assistant" and not last.get("tool_calls")
    output = body.output_config or AnthropicOutputConfig()
    if prefill and output.format is not None:
        # As Anthropic's API refuses it: a schema holds the whole reply, not what follows a
        # start the client wrote.
        raise HTTPAPIError(
            400,
            "output_config.format cannot be used with a prefilled final assistant message",
            code="invalid_value",
            param="output_config.format",
        )
    return GenerationRequest(
        prompt,
        messages=tuple(messages),
        tools=tools,
        tool_choice=tool_choice,
        response_format=engine_format(output.format),
        model=model,
        parallel_tool_calls=parallel,
        prefix=str(last["content"] or "") if prefill and last is not None else "",
        continue_final_message=prefill,
        caller=caller_of(request),
        relayed=None if output.effort is None else {"reasoning_effort": output.effort},
    )


def _relayed(conversation: GenerationRequest, body: MessagesBody) -> dict[str, Any] | None:
    """What a relay's upstream gets as given: the effort, and whom the message is for
    (``metadata.user_id``, chat's ``user``)."""
    relayed = dict(conversation.relayed or {})
    if body.metadata is not None and body.metadata.user_id is not None:
        relayed["user"] = body.metadata.user_id
    return relayed or None


async def handle_messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``: a message streamed as Anthropic's events, or one object."""
    app = request.app
    body = await read_model(request, MessagesBody)
    conversation = _conversation(request, body)
    policy = delivery_overrides(_sampling(body), app[CONFIG_KEY].policy, under="replystream.")
    model = conversation.model or served_model(app)
    generation = replace(
        conversation,
        sampling=sampling_params(_sampling(body), body.max_tokens),
        continuation=_sampling(body).upstream_continue,
        reasoning=body.thinks and policy.shows_thinking,
        names_stop_sequence=True,  # ``stop_reason: "stop_sequence"`` and its ``stop_sequence``
        relayed=_relayed(conversation, body),
    )
    engine = app[ENGINE_KEY]
    with refusals_naming(_FIELDS):
        thinking_text = not body.thinking_text_omitted
        if not body.stream:
            return await _whole(request, generation, model, policy, thinking_text)
        count_input = partial(_input_tokens, engine, generation)
        reply = await start_reply(
            request,
            generation,
            endpoint="/v1/messages",
            fmt=AnthropicStreamFormat(model, count_input, thinking_text),
            policy=policy,
            # None: the server's default, as on the other routes.
            resumable=body.replystream.resumable if body.replystream else None,
            # Its log holds nothing until the first token (``message_start`` waits for it):
            # a resume before then is told what its reader decides in this dialect too.
            dialect=DIALECT,
            keepalive_s=_sampling(body).keepalive_s,  # its resumes keep it too
        )
    return follow_started(request, reply, policy, keepalive=PING, notices=ReaderNotices())


def _input_tokens(engine: Engine, generation: GenerationRequest) -> int:
    """The prompt's tokens for a ``message_start`` that must go before the engine's first
    delta counted them (an error came first): the count that delta would have carried,
    found apart, as ``count_tokens`` answers it; a relay's estimate (its upstream counts)."""
    with contextlib.suppress(RequestRejected):
        counted = engine.count_prompt(generation)
        if counted is not None:
            return counted
    return engine.count_tokens(generation.prompt)


async def handle_count_tokens(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages/count_tokens``: the input tokens the same message would report
    (its ``message_start``'s ``usage.input_tokens``), as Anthropic's ``{"input_tokens"}``."""
    body = await read_model(request, MessagesInput)
    generation = _conversation(request, body)
    with refusals_naming(_FIELDS):
        counted = count_prompt(request, generation)
    return web.json_response({"input_tokens": counted})


async def _whole(
    request: web.Request,
    generation: GenerationRequest,
    model: str,
    policy: DeliveryPolicy,
    thinking_text: bool,
) -> web.StreamResponse:
    reply_id = ids.reply_id()

    def body(whole: Whole) -> dict[str, Any]:
        stop = whole.stop_sequence
        return message_object(
            reply_id,
            model,
            text=whole.text,
            stop_reason=stop_reason_of(whole.finish_reason, stop, whole.refused),
            usage=whole.usage,  # the engine's own count of the prompt when it gave one
            stop_sequence=stop,
            tool_calls=whole.tool_calls,
            thoughts=whole.thoughts,
            thinking_text=thinking_text,
        )

    def moderated(whole: Whole, violation: Violation) -> dict[str, Any]:
        message = message_object(
            reply_id,
            model,
            text=whole.text,
            stop_reason="refusal",
            usage=whole.usage,
            tool_calls=whole.tool_calls,
            thoughts=whole.thoughts,
            thinking_text=thinking_text,
        )
        message["replystream_moderation"] = moderated_payload(violation)
        return message

    return await buffered(
        request,
        generation,
        endpoint="/v1/messages",
        policy=policy,
        body=body,
        moderated_body=moderated,
        reply_id=reply_id,
    )


def add_anthropic_routes(app: web.Application) -> None:
    """Register Anthropic's Messages API on ``app``."""
    app.router.add_post("/v1/messages", handle_messages, expect_handler=expect_later)
    app.router.add_post(
        "/v1/messages/count_tokens", handle_count_tokens, expect_handler=expect_later
    )
