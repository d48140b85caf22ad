"""The declared shape of OpenAI's Responses API requests (``POST /v1/responses``, and the
count of its input, ``POST /v1/responses/input_tokens``, which takes the prompt's fields
alone): its input items, function tools, reasoning and text options, replystream's own fields
under ``replystream``; and the conversation a stored response keeps.

This file decides what that route accepts, field by field, and the checks within one body (a
background response is stored; ``stream_options`` only on a stream). Turning a body into a
request is ``server.responses_prompt``'s (its tools, ``server.tool_requests``'s). It must not
know about aiohttp or engines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator

from replystream.server.chat_message_schemas import MessageToolCall
from replystream.server.output_formats import ResponsesTextFormat
from replystream.server.schema_fields import (
    CHOICE_ERROR,
    ITEM_TAGS,
    BatchMs,
    BatchTokens,
    Finite,
    HoldbackTokens,
    JSONSchema,
    KeepaliveS,
    Metadata,
    MinTokens,
    ModerationConfig,
    Probability,
    PromptCacheOptions,
    PromptCacheRetention,
    Seed,
    Stop,
    Strict,
    Temperature,
    TokenCount,
    ToolMode,
    ToolName,
    TopK,
    TopLogprobs,
    choice_kind,
    content_kind,
    invalid,
    only,
)


class InputText(Strict):
    """Text in a Responses message: the client's (``input_text``) or, sent back as history,
    a model's (``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str
    # Kept with a stored response's input and listed back as sent.
    annotations: Annotated[list[Any], Finite] | None = None
    logprobs: Annotated[list[Any], Finite] | None = None  # sent back with output_text: no prompt


ResponseContent = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[InputText], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of input_text parts",
    ),
]


class RefusalPart(Strict):
    """A model's refusal to answer, in an assistant's message sent back as history (an
    output message's ``refusal`` part, as a relayed upstream's refusal is answered)."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal  # its words, as the conversation's text


def _part_kind(value: Any) -> str:
    """A message part's branch: a refusal, else text (whose ``type`` check names any other);
    of a part given (a dict) or made (a model, as it is written back)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "<refusal>" if kind == "refusal" else "<text_part>"


MessagePart = Annotated[
    Annotated[InputText, Tag("<text_part>")] | Annotated[RefusalPart, Tag("<refusal>")],
    Discriminator(_part_kind),
]
MessageContent = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[MessagePart], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of input_text parts",
    ),
]


class InputMessage(Strict):
    """One message item of a Responses ``input`` (an output item sent back keeps its id and
    status, which are read and not needed). An assistant's may hold a ``refusal`` part."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: MessageContent
    id: str | None = None
    status: str | None = None
    # An assistant message's label (OpenAI's models mark commentary apart from the final
    # answer, and ask clients to send it back): kept with the item, not part of the prompt.
    phase: Literal["commentary", "final_answer"] | None = None

    @model_validator(mode="after")
    def _refusal_is_the_assistants(self) -> InputMessage:
        if self.role != "assistant" and not isinstance(self.content, str):
            for place, part in enumerate(self.content):
                if isinstance(part, RefusalPart):
                    raise invalid(
                        "only an assistant message may hold a refusal part", f"content[{place}]"
                    )
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    """A ``function_call`` item sent back as history (the model's call)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    # Null in every call this server makes (its tools have no namespace, and the model calls
    # them itself), as the SDK's ``model_dump`` of one sends them back; a call of a tool in a
    # namespace, or made by a program, is one this server never offered.
    namespace: (
        Annotated[Any, only(None, "left out; this server's tools have no namespace")] | None
    ) = None
    caller: (
        Annotated[Any, only(None, "left out; here the model calls every tool itself")] | None
    ) = None


class FunctionCallOutputItem(Strict):
    """A ``function_call_output`` item: what the client's function returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: ResponseContent  # a string, or text parts (OpenAI's images and files: not read)
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """A ``reasoning`` item sent back as history: a response's thinking, as a client that
    keeps its own context (``store: false``) sends a response's output back whole. As
    ``thinking`` blocks on ``/v1/messages``, it is not part of the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ItemReference(Strict):
    """An ``item_reference`` input item: an item of a stored response (of its output, or of
    its input), named by its id in place of the item itself, as a client that keeps the
    conversation sends the items the server already holds (Vercel's AI SDK sends each
    earlier assistant message so while ``store`` is on). Its ``type`` may be left out."""

    type: Literal["item_reference"] | None = None
    id: str


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind is None:  # a message's type may be left out, and so may a reference's
        kind = "item_reference" if "role" not in value and "id" in value else "message"
    return f"<{kind}>" if kind in ITEM_TAGS else None


ITEM_ERROR = (
    "must be an input item: a message, a function_call, a function_call_output, a reasoning "
    "item or an item_reference"
)

InputItem = Annotated[
    Annotated[InputMessage, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[ReasoningItem, Tag("<reasoning>")],
    Discriminator(_item_kind, custom_error_type="item_type", custom_error_message=ITEM_ERROR),
]
# What a request's ``input`` list may hold: an item, or a reference to one already stored.
RequestItem = Annotated[
    Annotated[InputMessage, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[ReasoningItem, Tag("<reasoning>")]
    | Annotated[ItemReference, Tag("<item_reference>")],
    Discriminator(_item_kind, custom_error_type="item_type", custom_error_message=ITEM_ERROR),
]


_INPUT_KIND = Discriminator(
    content_kind,
    custom_error_type="input_type",
    custom_error_message="must be a string or a non-empty list of input items",
)
# A stored response's input, as kept: its references already replaced by their items.
ResponseInput = Annotated[
    Annotated[str, Tag("<string>")]
    | Annotated[Annotated[list[InputItem], Field(min_length=1)], Tag("<parts>")],
    _INPUT_KIND,
]
# A request's ``input``, as sent.
RequestInput = Annotated[
    Annotated[str, Tag("<string>")]
    | Annotated[Annotated[list[RequestItem], Field(min_length=1)], Tag("<parts>")],
    _INPUT_KIND,
]


class FunctionTool(Strict):
    """A function tool of ``POST /v1/responses`` (the one kind this server offers)."""

    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Annotated[
    Annotated[ToolMode, Tag("<mode>")] | Annotated[NamedFunction, Tag("<named>")],
    Discriminator(choice_kind, custom_error_type="tool_choice", custom_error_message=CHOICE_ERROR),
]


class ResponsesExtensions(Strict):
    """replystream's own fields of a Responses request, under ``replystream`` (a name OpenAI's
    API does not use): sampling the Responses API has no field for, and delivery policies."""

    seed: Seed | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    min_tokens: MinTokens | None = None
    ignore_eos: bool | None = None
    stop: Stop | None = None
    batch_tokens: BatchTokens | None = None
    batch_ms: BatchMs | None = None
    holdback_tokens: HoldbackTokens | None = None
    keepalive_s: KeepaliveS | None = None
    upstream_continue: bool | None = None


class ResponsesReasoning(Strict):
    """``reasoning`` of ``POST /v1/responses``: a reasoning model's effort, passed to a relay's
    upstream as chat's ``reasoning_effort``; and the summary asked for, which is given as
    the thinking itself (a relay has no summariser: the reasoning item holds it whole)."""

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesText(Strict):
    """``text`` of ``POST /v1/responses``: the output's format (plain text, or JSON as chat's
    ``response_format`` asks it) and its ``verbosity`` (echoed, as the API does; passed to a
    relay's upstream as chat's ``verbosity``, which the built-in engines ignore)."""

    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(Strict):
    """``stream_options`` of ``POST /v1/responses``: as chat's, without ``include_usage``
    (the terminal event always carries the usage)."""

    include_obfuscation: (
        Annotated[bool, only(False, "false; this server does not pad events")] | None
    ) = None


# What ``include`` may ask for: the one addition to the output this server makes.
LOGPROBS_INCLUDED = "message.output_text.logprobs"
# The encrypted form of a response's reasoning, for a client that keeps the conversation
# itself (``store: false``) to send back. Taken, and nothing to add: a reasoning item's
# thinking is in its ``content`` in the clear, and one sent back is left out of the prompt,
# as every earlier turn's thinking is, so such a conversation goes on as a stored one does.
# OpenAI takes it so from a model that does not reason; Vercel's AI SDK asks it of every
# reasoning model's response with ``store: false``.
REASONING_INCLUDED = "reasoning.encrypted_content"


def _honoured_includes(values: list[str]) -> list[str]:
    for value in values:
        if value not in (LOGPROBS_INCLUDED, REASONING_INCLUDED):
            message = (
                f"include may hold only {LOGPROBS_INCLUDED!r} and {REASONING_INCLUDED!r}: "
                f"this server adds nothing else to the output ({value[:100]!r} is not "
                "honoured)"
            )
            raise invalid(message)
    return values


class ResponsesPrompt(Strict):
    """What a response's prompt is made of: the fields ``POST /v1/responses`` and
    ``POST /v1/responses/input_tokens`` share (OpenAI's spec gives the count exactly these,
    and ``personality``), so the two routes cannot read one input two ways."""

    unknown_field: ClassVar[Literal["native", "openai"]] = "openai"
    field_codes: ClassVar[Mapping[str, str]] = {
        "truncation": "unsupported_parameter",
        "conversation": "unsupported_parameter",
    }

    model: str | None = None
    input: RequestInput | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ResponsesReasoning | None = None
    text: ResponsesText | None = None
    # "auto" would let the server drop input from the middle to fit the context: this one
    # never drops input (a prompt too long is a 400), so it takes the one value it honours.
    truncation: (
        Annotated[str, only("disabled", "disabled; this server never drops input")] | None
    ) = None
    # In the spec of both routes, and nothing this server can honour: it keeps no
    # conversations (``previous_response_id`` continues one).
    conversation: (
        Annotated[Any, only(None, "left out; this server keeps no conversations")] | None
    ) = None


class InputTokensBody(ResponsesPrompt):
    """``POST /v1/responses/input_tokens``: a response's prompt, to count. Its ``input`` may
    be left out to count where a ``previous_response_id``'s conversation is (the route
    refuses a body with neither, as a missing ``input``)."""

    field_codes: ClassVar[Mapping[str, str]] = {
        **ResponsesPrompt.field_codes,
        "personality": "unsupported_parameter",
    }

    # In the count's spec, and nothing this server can honour: it has no style presets.
    personality: (
        Annotated[Any, only(None, "left out; this server has no personality presets")] | None
    ) = None


def _null_is(default: bool) -> BeforeValidator:
    """A flag OpenAI's spec lets be null, meaning its default: the openai SDK types them
    ``Optional[bool]`` and sends ``None`` as null."""
    return BeforeValidator(lambda value: default if value is None else value)


class ResponsesBody(ResponsesPrompt):
    """``POST /v1/responses``: a prompt (``input`` required) and the fields that shape the
    reply."""

    field_codes: ClassVar[Mapping[str, str]] = {
        **ResponsesPrompt.field_codes,
        "include": "unsupported_parameter",
    }

    input: RequestInput
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stream: Annotated[bool, _null_is(False)] = False
    store: Annotated[bool, _null_is(True)] = True
    metadata: Metadata | None = None
    background: Annotated[bool, _null_is(False)] = False
    user: str | None = None
    service_tier: str | None = None  # accepted and ignored, as on chat
    safety_identifier: str | None = None  # accepted and ignored, as on chat
    prompt_cache_key: str | None = None
    # OpenAI's bound on calls of its built-in tools (search, code, ...) in one response:
    # this server has none of them, so any bound holds; repeated in the response object.
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    stream_options: ResponsesStreamOptions | None = None
    # What the output should carry besides itself (logprobs, encrypted reasoning, ...). This
    # server adds its tokens' log probabilities, takes encrypted reasoning (above), and
    # refuses the rest.
    include: Annotated[list[str], AfterValidator(_honoured_includes)] | None = None
    # As OpenAI's spec has them, apart: ``include`` decides whether the output shows log
    # probabilities, ``top_logprobs`` how many of the likeliest tokens each one lists.
    top_logprobs: TopLogprobs | None = None
    replystream: ResponsesExtensions | None = None
    # OpenAI's, for features this server lacks: taken at null, refused otherwise as
    # ``unsupported_parameter`` (not as unknown fields, which they are not).
    prompt: Annotated[Any, only(None, "left out; this server stores no prompts")] | None = None
    context_management: (
        Annotated[Any, only(None, "left out; this server never compacts a conversation")] | None
    ) = None
    prompt_cache_retention: PromptCacheRetention | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    moderation: ModerationConfig | None = None

    @property
    def shown_logprobs(self) -> int | None:
        """The likeliest tokens each token's log probability lists in the output (None: the
        output shows none, so none are asked of the engine)."""
        if not self.include or LOGPROBS_INCLUDED not in self.include:
            return None
        return self.top_logprobs or 0

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesBody:
        if self.background and not self.store:
            message = "a background response must be stored (store: true) to be read later"
            raise invalid(message, "background")
        return self

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> ResponsesBody:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        return self


class Turn(Strict):
    """One message of a stored conversation (what a Responses request sent, as chat). An
    assistant turn of tool calls alone has no ``content``: a continued history is kept
    without its null fields, so a missing one is null."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class Conversation(Strict):
    """What a stored response keeps in ``ReplyInfo.context``: its conversation so far (as
    chat, for a response that continues it), and its request's own ``input`` as the request
    gave it (for ``GET /v1/responses/{id}/input_items``; None in what a server before that
    route kept)."""

    messages: list[Turn]
    input: ResponseInput | None = None
    # Made with ``background: true`` (None in what a server before it kept): read by a cancel
    # when a long log no longer holds the response's first event, which says it too.
    background: bool | None = None
    # The object it was created as, but its id (None in what a server before it kept): what a
    # read tells of it while it runs once a long log no longer holds its first event.
    opened: dict[str, Any] | None = None


def kept_conversation(
    messages: Sequence[Mapping[str, Any]],
    given: ResponseInput | None,
    *,
    background: bool,
    opened: Mapping[str, Any],
) -> str:
    """The ``Conversation`` a stored response keeps, as JSON: ``messages`` (the history and
    this request's input, as chat), ``given``, the request's validated ``input`` (the items
    it referenced in place), whether it runs in the ``background``, and the object it was
    ``opened`` as (its id left out)."""
    kept: dict[str, Any] = {"messages": list(messages), "background": background}
    if given is None or isinstance(given, str):
        kept["input"] = given
    else:
        kept["input"] = [item.model_dump(exclude_none=True) for item in given]
    kept["opened"] = {name: value for name, value in opened.items() if name != "id"}
    return json.dumps(kept)
