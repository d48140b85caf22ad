"""OpenAI-compatible request bodies (chat and legacy completions): parse, validate, name the field.

This file decides which fields ``POST /v1/chat/completions`` and ``POST /v1/completions``
honour (``model``, ``messages`` / ``prompt``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``), which they
accept and ignore as vLLM and llama.cpp do (``user``, penalties, ``logit_bias``, ``n=1``,
``logprobs=false``, ``metadata``, ...), and which replystream extensions they take (``top_k``
and the delivery overrides of the native endpoint, ``resumable``). Anything else, or a value
out of range, is an ``HTTPAPIError`` (400, or 404 ``model_not_found``) raised before any
generation starts. It must not know about HTTP handlers, engines or wire formats.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.server.errors import HTTPAPIError
from replystream.server.native import (
    delivery_overrides,
    integer_field,
    number_field,
    parse_stop,
    prompt_from_messages,
)

MAX_TOKENS_LIMIT = 1 << 20
LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
EXTENSIONS = frozenset(
    {"top_k", "batch_tokens", "batch_ms", "holdback_tokens", "keepalive_s", "resumable"}
)
# Accepted and ignored: they change nothing a single-choice reply without tools shows.
IGNORED = frozenset(
    {
        "user",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
        "reasoning_effort",
        "verbosity",
    }
)
COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "logprobs",
    }
)
CHAT_FIELDS = (
    COMMON
    | IGNORED
    | EXTENSIONS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tool_choice",
        "tools",
    }
)
COMPLETION_FIELDS = COMMON | IGNORED | EXTENSIONS | {"prompt", "echo", "suffix", "best_of"}


@dataclass(frozen=True, slots=True)
class CompletionAsk:
    """A validated OpenAI-style request."""

    generation: GenerationRequest
    stream: bool
    include_usage: bool
    policy: DeliveryPolicy
    resumable: bool | None  # None: the server's default


def bad(param: str, message: str, code: str = "invalid_value") -> HTTPAPIError:
    return HTTPAPIError(400, message, code=code, param=param)


def model_not_found(model: object) -> HTTPAPIError:
    return HTTPAPIError(
        404,
        f"The model {model!r} does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def _require(body: dict[str, Any], name: str, allowed: tuple[object, ...], why: str) -> None:
    value = body.get(name)
    if value is not None and value not in allowed:
        raise bad(name, f"{name} must be {why}; this server makes one plain-text choice")


def _common_checks(body: dict[str, Any], fields: frozenset[str], model: str) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(
            unknown[0], f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter"
        )
    requested = body.get("model")
    if requested is not None and requested != model:
        raise model_not_found(requested)
    integer_field(body, "n", 1, 1)
    _require(body, "logprobs", (False, 0), "false")
    for name in ("presence_penalty", "frequency_penalty"):
        number_field(body, name, -2.0, 2.0)


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad("stream_options", "stream_options must be an object")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("stream_options.include_usage", "include_usage must be true or false")
    return include and stream


def _ask(
    body: dict[str, Any],
    prompt: str,
    param: str,
    max_tokens: int | None,
    defaults: DeliveryPolicy,
    max_prompt_chars: int,
) -> CompletionAsk:
    if len(prompt) > max_prompt_chars:
        raise bad(
            param,
            f"the prompt is {len(prompt)} characters; this server's limit is {max_prompt_chars}",
            "context_length_exceeded",
        )
    temperature = number_field(body, "temperature", 0.0, 2.0)
    top_p = number_field(body, "top_p", 0.0, 1.0)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=integer_field(body, "top_k", 0, MAX_TOKENS_LIMIT) or 0,
        seed=integer_field(body, "seed", 0, 2**63 - 1),
        stop=parse_stop(body.get("stop")),
    )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    resumable = body.get("resumable")
    if resumable is not None and not isinstance(resumable, bool):
        raise bad("resumable", "resumable must be true or false")
    if resumable and not stream:
        raise bad("resumable", "a resumable reply must be streamed (stream: true)")
    try:
        policy = delivery_overrides(body, defaults)
    except ValueError as exc:  # a combination the policy itself refuses
        raise HTTPAPIError(400, str(exc), code="invalid_value") from exc
    return CompletionAsk(
        GenerationRequest(prompt, sampling),
        stream,
        _stream_options(body, stream),
        policy,
        resumable,
    )


def parse_chat_request(
    body: dict[str, Any], *, model: str, defaults: DeliveryPolicy, max_prompt_chars: int
) -> CompletionAsk:
    """Validate a ``POST /v1/chat/completions`` body."""
    _common_checks(body, CHAT_FIELDS, model)
    if "messages" not in body:
        raise bad("messages", "messages is required", "missing_required_parameter")
    prompt = prompt_from_messages(body["messages"])
    integer_field(body, "top_logprobs", 0, 0)
    if body.get("tools"):
        raise bad("tools", "tools are not supported by this server", "unsupported_parameter")
    _require(body, "tool_choice", ("none",), '"none"')
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad(
            "response_format", 'response_format must be {"type": "text"}', "unsupported_parameter"
        )
    limit = integer_field(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    legacy_limit = integer_field(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    max_tokens = limit if limit is not None else legacy_limit
    ask = _ask(body, prompt, "messages", max_tokens, defaults, max_prompt_chars)
    messages = tuple(body["messages"])  # validated above; relayed unchanged to chat upstreams
    return replace(ask, generation=replace(ask.generation, messages=messages))


def parse_completion_request(
    body: dict[str, Any], *, model: str, defaults: DeliveryPolicy, max_prompt_chars: int
) -> CompletionAsk:
    """Validate a ``POST /v1/completions`` (legacy) body."""
    _common_checks(body, COMPLETION_FIELDS, model)
    if "prompt" not in body:
        raise bad("prompt", "prompt is required", "missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt must be a string (or a list of one string)")
    _require(body, "echo", (False,), "false")
    _require(body, "best_of", (1,), "1")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix is not supported by this server", "unsupported_parameter")
    max_tokens = integer_field(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    if "max_tokens" not in body:
        max_tokens = LEGACY_DEFAULT_MAX_TOKENS
    return _ask(body, prompt, "prompt", max_tokens, defaults, max_prompt_chars)
