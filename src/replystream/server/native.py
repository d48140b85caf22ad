"""The native reply endpoint's request: a validated ``ReplyBody`` turned into a reply to start.

``POST /v1/replies`` takes::

    {"prompt": "..."}  or  {"messages": [{"role": "user", "content": "..."}, ...]}
    sampling:  max_tokens, temperature, top_p, top_k, seed, stop (a string or a list)
    delivery:  stream (default true), batch_tokens, batch_ms, holdback_tokens, keepalive_s
    resume:    resumable (true/false), disconnect ("cancel" or "detach": resumable too)
    relay:     upstream_continue (true/false; default: serve's --upstream-continue)

Each field's type and range, and the rules across fields, are declared in
``server.native_schemas.ReplyBody`` and checked by ``server.validation``; this file checks what
depends on the server (the prompt limit, a policy's own rules) and builds the
``GenerationRequest`` and ``DeliveryPolicy``. Every mistake is an ``HTTPAPIError`` (400 with
the field in ``param``), never a 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Caller, GenerationRequest, SamplingParams
from replystream.server.chat_message_schemas import Message
from replystream.server.errors import HTTPAPIError
from replystream.server.native_schemas import ReplyBody
from replystream.server.refusal_names import FieldNames
from replystream.server.replies import Disconnect
from replystream.server.schema_fields import SamplingFields
from replystream.server.tool_requests import (
    OriginsIn,
    check_calls_answered_next,
    check_tool_answers,
    prompt_of,
)


@dataclass(frozen=True, slots=True)
class ReplyRequest:
    generation: GenerationRequest
    stream: bool
    policy: DeliveryPolicy
    resumable: bool | None  # None: the server's default
    disconnect: Disconnect | None  # None: detach if resumable, else cancel
    fields: FieldNames  # what a refusal's field is called here (``native_fields``)


# A relay's chat request's fields the native request has under the same names; its prompt
# and limit are the client's own (``native_fields``); any other is left out of a refusal.
_NATIVE_AS_SENT = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "seed",
    "stop",
    "max_tokens",
    "model",
)


def native_fields(prompt_field: str) -> FieldNames:
    """A native request's names for the fields a refusal names, its prompt sent as
    ``prompt_field`` (``prompt``, or ``messages``)."""
    return FieldNames(
        {} if prompt_field == "prompt" else {"prompt": prompt_field},
        {
            **{name: name for name in _NATIVE_AS_SENT},
            "messages": prompt_field,
            "max_completion_tokens": "max_tokens",
        },
    )


def bad(param: str | None, message: str, code: str = "invalid_value") -> HTTPAPIError:
    return HTTPAPIError(400, message, code=code, param=param)


def check_prompt_size(prompt: str, limit: int, param: str, *, noun: str = "prompt") -> None:
    """Refuse a prompt longer than the server takes, as the OpenAI-family routes word it."""
    if len(prompt) > limit:
        message = f"the {noun} is {len(prompt)} characters; this server's limit is {limit}"
        raise bad(param, message, "context_length_exceeded")


# What the OpenAI SDK adds to an assistant message it received and sends back, and which
# says nothing its other fields do not (or what this server never makes): not relayed, so
# an upstream that takes only the documented message is not refused it. Nor is the
# thinking a client sends back: no part of the prompt here, as on every route (a thinking
# block, a reasoning item), and a field no chat upstream is bound to take.
SDK_ECHOES: dict[str, Any] = {
    "parsed": True,
    "annotations": True,
    "audio": True,
    "function_call": True,
    "reasoning_content": True,
    "reasoning": True,
    "tool_calls": {"__all__": {"index": True, "function": {"parsed_arguments": True}}},
}


def relayed_messages(messages: Sequence[Message]) -> tuple[Mapping[str, Any], ...]:
    """The messages as the client sent them, for engines that take chat messages whole
    (every tool result checked to answer an earlier call, and every call answered by the tool
    messages right after it, as OpenAI's chat API has it; the native route's messages are
    chat's, relayed to the same upstreams, so they are checked alike). Their plain-text prompt
    is ``tool_requests.prompt_of`` them (one ``role: content`` line each, one per tool call)."""
    relayed = tuple(
        message.model_dump(exclude_unset=True, exclude=SDK_ECHOES) for message in messages
    )
    check_tool_answers(relayed, OriginsIn("messages"))
    check_calls_answered_next(relayed, OriginsIn("messages"))
    return relayed


def sampling_params(
    body: SamplingFields, max_tokens: int | None, *, logprobs: int | None = None
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
        ignore_eos=bool(body.ignore_eos),
        seed=body.seed,
        stop=body.stop or (),
        logprobs=logprobs,
        **penalties(body),
    )


def penalties(body: SamplingFields) -> dict[str, Any]:
    """The penalties and logit biases the body gives (fields only the OpenAI routes have;
    none elsewhere)."""
    names = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    given: dict[str, Any] = {
        name: value for name in names if (value := getattr(body, name, None)) is not None
    }
    biases: dict[str, float] | None = getattr(body, "logit_bias", None)
    if biases:
        given["logit_bias"] = tuple(sorted((int(token), bias) for token, bias in biases.items()))
    return given


def delivery_overrides(
    body: SamplingFields, defaults: DeliveryPolicy, *, under: str = ""
) -> DeliveryPolicy:
    """The server's delivery policy with this request's overrides applied; ``under``: where
    the route's client puts these fields (``replystream.`` on the Responses and Messages
    APIs), for the name a refusal gives."""
    changes: dict[str, object] = {
        name: value
        for name in ("batch_tokens", "batch_ms", "holdback_tokens", "keepalive_s")
        if (value := getattr(body, name)) is not None
    }
    if not changes:
        return defaults
    held = changes.get("holdback_tokens")
    if defaults.checks and isinstance(held, int) and held < defaults.holdback_tokens:
        # The server's window is what keeps every part of a banned phrase from being sent:
        # a request may widen it, never narrow it.
        message = (
            f"holdback_tokens is {held}; this server holds back at least "
            f"{defaults.holdback_tokens} tokens for its moderation checks"
        )
        raise bad(f"{under}holdback_tokens", message)
    # Each field's schema (``schema_fields``) keeps it within what the policy takes.
    return defaults.with_overrides(**changes)


def parse_reply_request(
    body: ReplyBody,
    defaults: DeliveryPolicy,
    max_prompt_chars: int,
    *,
    caller: Caller,
    model: str | None,
) -> ReplyRequest:
    """Check a native reply request against the server's defaults and limits; ``caller``:
    who asks (``context.caller_of``); ``model``: the name it routes by
    (``openai_api.routed_model`` of its ``model``)."""
    messages = None
    if body.messages is not None:
        messages = relayed_messages(body.messages)
        prompt, param = prompt_of(messages), "messages"
    else:
        prompt, param = body.prompt or "", "prompt"
    if len(prompt) > max_prompt_chars:
        raise HTTPAPIError(
            400,
            f"prompt is {len(prompt)} characters; the limit is {max_prompt_chars}",
            code="prompt_too_long",
            param=param,
        )
    policy = delivery_overrides(body, defaults)
    generation = GenerationRequest(
        prompt,
        sampling_params(body, body.max_tokens),
        messages,
        continuation=body.upstream_continue,
        caller=caller,
        model=model,
        reasoning=policy.shows_thinking,
        names_stop_sequence=True,  # its ``done`` event and body name the stop string
    )
    return ReplyRequest(
        generation,
        body.stream,
        policy,
        body.resumable_asked,
        body.disconnect,
        native_fields(param),
    )
