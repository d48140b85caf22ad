"""OpenAI-compatible requests (chat and legacy completions): a validated body turned into a reply.

Which fields ``POST /v1/chat/completions`` and ``POST /v1/completions`` honour, accept at the
one value honoured, accept and ignore (as vLLM and llama.cpp do), or refuse, is declared in
``server.openai_schemas`` (``ChatBody``, ``CompletionBody``) and checked by ``server.validation``.
This file checks what depends on the server (the prompt limit; which models are served is
``openai_api.routed_model``'s) and builds the ``GenerationRequest`` and ``DeliveryPolicy``;
every mistake is an ``HTTPAPIError`` (400) raised before any generation starts. It must not know
about HTTP handlers, engines or wire formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Caller, GenerationRequest
from replystream.server.errors import HTTPAPIError
from replystream.server.native import (
    check_prompt_size,
    delivery_overrides,
    relayed_messages,
    sampling_params,
)
from replystream.server.openai_schemas import ChatBody, CompletionBody, OpenAIBody
from replystream.server.output_formats import engine_format
from replystream.server.refusal_names import FieldNames
from replystream.server.tool_requests import chat_tools, prompt_of

LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A legacy client sent the count of alternatives as ``logprobs``; an upstream is sent a
# legacy completion too, with these fields under the names the client gave them.
_LEGACY_AS_SENT = (
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
)
_LEGACY_FIELDS = FieldNames({"top_logprobs": "logprobs"}, {name: name for name in _LEGACY_AS_SENT})


@dataclass(frozen=True, slots=True)
class CompletionAsk:
    """A validated OpenAI-style request."""

    generation: GenerationRequest
    stream: bool
    include_usage: bool
    policy: DeliveryPolicy
    resumable: bool | None  # None: the server's default
    n: int = 1  # choices, each its own generation
    # The fields a refusal names (an engine's ``prompt``, ``max_tokens``; an upstream's chat
    # fields) as this request's client sent them (chat's ``messages``, a legacy ``prompt``).
    fields: FieldNames = field(default_factory=FieldNames)
    # Where a legacy completion's ``text_offset`` begin: after its prompt's characters.
    text_offset_from: int = 0
    keepalive_s: float | None = None  # the keep-alive interval asked (None: none)


def model_not_found(model: object) -> HTTPAPIError:
    return HTTPAPIError(
        404,
        f"The model {model!r} does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def _ask(
    body: OpenAIBody,
    generation: GenerationRequest,
    param: str,
    *,
    policy: DeliveryPolicy,
    max_prompt_chars: int,
    fields: FieldNames,
    text_offset_from: int = 0,
) -> CompletionAsk:
    check_prompt_size(generation.prompt, max_prompt_chars, param)
    stream = bool(body.stream)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    n = 1 if body.n is None else body.n
    return CompletionAsk(
        generation,
        stream,
        include_usage,
        policy,
        body.resumable,
        n,
        fields,
        text_offset_from,
        body.keepalive_s,
    )


# Who the request is for and how it is to be served, at an upstream that keeps accounts
# (OpenAI's own, in front of which a relay is a gateway): sent on as the client gave them.
ACCOUNT_FIELDS = ("user", "safety_identifier", "service_tier")
# Chat's too: a reasoning model's effort, and a completion stored with its metadata.
CHAT_RELAYED = (*ACCOUNT_FIELDS, "reasoning_effort", "verbosity", "metadata", "store")


def relayed_fields(
    body: Any, names: tuple[str, ...], already: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The fields of ``body`` among ``names`` the client gave, for a relay's upstream, with
    what the request had for it ``already`` (an effort its prompt's fields gave)."""
    given = dict(already or {})
    given.update((name, value) for name in names if (value := getattr(body, name)) is not None)
    return given or None


def parse_chat_request(
    body: ChatBody,
    *,
    model: str | None,
    defaults: DeliveryPolicy,
    max_prompt_chars: int,
    caller: Caller,
) -> CompletionAsk:
    """Check a ``POST /v1/chat/completions`` body against the server; ``model``: the name
    it routes by (``routed_model``: None for the server's default)."""
    limit = body.max_completion_tokens
    max_tokens = limit if limit is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = sampling_params(body, max_tokens, logprobs=logprobs)
    tools, tool_choice = chat_tools(body.tools, body.tool_choice)
    messages = relayed_messages(body.messages)  # relayed unchanged to chat upstreams
    policy = delivery_overrides(body, defaults)
    generation = GenerationRequest(
        prompt_of(messages),
        sampling,
        messages,
        tools,
        tool_choice,
        engine_format(body.response_format),
        model=model,
        prefix=body.prefix,
        continue_final_message=bool(body.continue_final_message),
        add_generation_prompt=body.add_generation_prompt,
        chat_template_kwargs=body.chat_template_kwargs,
        continuation=body.upstream_continue,
        parallel_tool_calls=body.parallel_tool_calls,
        prompt_cache_key=body.prompt_cache_key,
        relayed=relayed_fields(body, CHAT_RELAYED),
        reasoning=policy.shows_thinking,
        caller=caller,
    )
    # The token limit under the name the client gave it (either, given both: they agree),
    # whichever an engine or an upstream names.
    limit_name = "max_tokens" if limit is None else "max_completion_tokens"
    limits = {"max_tokens": limit_name, "max_completion_tokens": limit_name}
    return _ask(
        body,
        generation,
        "messages",
        policy=policy,
        max_prompt_chars=max_prompt_chars,
        fields=FieldNames({"prompt": "messages", **limits}),  # an upstream's: chat's, too
    )


def parse_completion_request(
    body: CompletionBody,
    *,
    model: str | None,
    defaults: DeliveryPolicy,
    max_prompt_chars: int,
    caller: Caller,
) -> CompletionAsk:
    """Check a ``POST /v1/completions`` (legacy) body against the server."""
    max_tokens = LEGACY_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    sampling = sampling_params(body, max_tokens, logprobs=body.logprobs)
    generation = GenerationRequest(
        body.prompt,
        sampling,
        model=model,
        continuation=body.upstream_continue,
        prompt_cache_key=body.prompt_cache_key,
        relayed=relayed_fields(body, ACCOUNT_FIELDS),
        caller=caller,
        raw_prompt=True,
    )
    return _ask(
        body,
        generation,
        "prompt",
        policy=delivery_overrides(body, defaults),  # a legacy completion shows no thinking
        max_prompt_chars=max_prompt_chars,
        fields=_LEGACY_FIELDS,
        text_offset_from=len(body.prompt),
    )
