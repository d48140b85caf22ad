"""What a Responses request's prompt is: its ``input`` (each ``item_reference`` replaced by
the stored item it names) as chat messages, after the history a ``previous_response_id``
continues, with its ``instructions`` first; and the request that
prompt makes, checked (tool calls and results, the prompt limit, tools and ``tool_choice``,
the model).

``POST /v1/responses`` (``server.responses_api``) adds the sampling to that request and starts
it; ``POST /v1/responses/input_tokens`` (``server.responses_input_tokens``) counts it. Both
build it here, so a count is the prompt the response would have. This file must not know how
a reply is started or how its events are framed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from replystream.engine.base import GenerationRequest
from replystream.server.context import CONFIG_KEY, caller_of
from replystream.server.errors import HTTPAPIError
from replystream.server.native import bad, check_prompt_size
from replystream.server.openai_api import routed_model
from replystream.server.output_formats import engine_format
from replystream.server.refusal_names import FieldNames
from replystream.server.responses_references import resolved_input
from replystream.server.responses_schemas import ResponseInput, ResponsesPrompt
from replystream.server.responses_stored import (
    find_response,
    response_reply_id,
    response_said,
    stored_conversation,
)
from replystream.server.resume_points import not_found_here
from replystream.server.tool_requests import (
    Origin,
    answers_after_calls,
    check_calls_answered,
    check_tool_answers,
    prompt_of,
    responses_messages,
    responses_tools,
)

Messages = list[dict[str, Any]]
# A Responses client sent the prompt (the messages a chat template or an upstream refuses)
# as ``input``, the limit as ``max_output_tokens``, sampling the API has no field for under
# ``replystream``; an upstream's logprobs flag stands for an ``include``, left out.
_PROMPT_AND_LIMIT = {"messages": "input", "max_tokens": "max_output_tokens"}
_AS_SENT = (
    "temperature",
    "top_p",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
)
_EXTENSIONS = {
    name: f"replystream.{name}"
    for name in ("seed", "top_k", "min_p", "min_tokens", "ignore_eos", "stop")
}
RESPONSES_FIELDS = FieldNames(
    {"prompt": "input", "response_format": "text.format", **_PROMPT_AND_LIMIT, **_EXTENSIONS},
    {
        **{name: name for name in _AS_SENT},
        **_PROMPT_AND_LIMIT,
        "max_completion_tokens": "max_output_tokens",
        "reasoning_effort": "reasoning.effort",
        "verbosity": "text.verbosity",
        "response_format": "text.format",
        **_EXTENSIONS,
    },
)


def input_messages(given: ResponseInput | None) -> tuple[Messages, list[Origin]]:
    """A request's ``input`` (its references resolved) as chat messages, with where in it
    each came from."""
    if given is None:  # a count of where a previous response's conversation is
        return [], []
    if isinstance(given, str):
        return [{"role": "user", "content": given}], [Origin("input")]
    return responses_messages(given)


async def _history(request: web.Request, previous: str) -> Messages:
    """The conversation a ``previous_response_id`` continues: its history and input, then
    its output."""
    try:
        reply_id = response_reply_id(previous, "previous_response_id")
        store, _, _ = await find_response(request, reply_id, "previous_response_id")
        # Deleted or expired while read, the response is as gone as one never found.
        kept = await stored_conversation(store, reply_id)
        said = await response_said(store, reply_id, "previous_response_id")
    except HTTPAPIError as exc:
        if exc.status != 404:
            raise
        # OpenAI's code for it (a 400, the request's own field at fault), which clients such
        # as coding agents read to send the whole conversation instead.
        raise HTTPAPIError(
            400,
            not_found_here(
                request.app,
                f"no response {previous!r} was found to continue (previous_response_id): it "
                "never existed here, was deleted, or has expired",
            ),
            code="previous_response_not_found",
            param="previous_response_id",
        ) from None
    if said is None:
        raise bad("previous_response_id", f"response {previous} has not finished yet")
    history: Messages = []
    if kept is not None:
        history = [turn.model_dump(exclude_none=True) for turn in kept.messages]
    calls = [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in said.calls
    ]
    if calls:
        message = {"role": "assistant", "content": said.text or None, "tool_calls": calls}
        return [*history, message]
    return [*history, {"role": "assistant", "content": said.text}]


@dataclass(frozen=True, slots=True)
class ResponsePrompt:
    """A Responses request's prompt: its conversation (the history a ``previous_response_id``
    continues, then the input, as chat: what a stored response keeps for the next one), and
    the request it makes, with no sampling."""

    conversation: Messages
    generation: GenerationRequest
    given: ResponseInput | None  # the request's ``input``, each item it referenced in place


async def response_prompt(request: web.Request, body: ResponsesPrompt) -> ResponsePrompt:
    """The prompt ``body`` makes, checked as a response's is (the model, the previous
    response, tool calls and results, the prompt limit, tools and ``tool_choice``)."""
    app = request.app
    model = routed_model(app, body.model)
    given = await resolved_input(request, body.input)
    conversation, origins = input_messages(given)
    if body.previous_response_id is not None:
        history = await _history(request, body.previous_response_id)
        conversation = [*history, *conversation]
        # A stored turn was checked when it was made: what it holds is the earlier response's.
        origins = [Origin("previous_response_id")] * len(history) + origins
    messages = list(conversation)
    if body.instructions:  # the request's own: not carried on to the next response
        messages.insert(0, {"role": "system", "content": body.instructions})
        origins = [Origin("instructions"), *origins]
    check_tool_answers(messages, origins)
    check_calls_answered(messages, origins)
    messages = answers_after_calls(messages)  # as chat has them, for a chat engine or upstream
    prompt = prompt_of(messages)
    check_prompt_size(prompt, app[CONFIG_KEY].max_prompt_chars, "input", noun="input")
    tools, tool_choice = responses_tools(body.tools, body.tool_choice)
    effort = None if body.reasoning is None else body.reasoning.effort
    verbosity = None if body.text is None else body.text.verbosity
    # Chat's names for them, as a relay asks its upstream (the upstream decides what it takes).
    relayed = {"reasoning_effort": effort, "verbosity": verbosity}
    generation = GenerationRequest(
        prompt,
        messages=tuple(messages),
        tools=tools,
        tool_choice=tool_choice,
        response_format=engine_format(None if body.text is None else body.text.format),
        model=model,
        parallel_tool_calls=body.parallel_tool_calls,
        relayed={k: v for k, v in relayed.items() if v is not None} or None,
        caller=caller_of(request),
    )
    return ResponsePrompt(conversation, generation, given)
