"""The declared shape of the OpenAI-compatible requests: ``POST /v1/chat/completions`` (with
its tools and tool choice) and the legacy ``POST /v1/completions``.

This file decides what each accepts: fields honoured, fields accepted at the one value this
server honours, fields accepted and ignored (all listed in docs/api.md), and the checks
within one body. Turning a body into a request, and the checks against the served model, are
``server.openai_requests``'s. It must not know about aiohttp or engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Discriminator, Field, PlainValidator, Tag, model_validator
from pydantic_core import PydanticCustomError

from replystream.server.chat_message_schemas import Messages
from replystream.server.output_formats import ChatResponseFormat
from replystream.server.schema_fields import (
    CHOICE_ERROR,
    MAX_LOGIT_BIASES,
    Bias,
    ChoiceCount,
    Finite,
    JSONSchema,
    LegacyLogprobs,
    Metadata,
    ModerationConfig,
    Penalty,
    PromptCacheOptions,
    PromptCacheRetention,
    RepetitionPenalty,
    SamplingFields,
    Strict,
    TokenCount,
    TokenIdKey,
    ToolMode,
    ToolName,
    TopLogprobs,
    choice_kind,
    invalid,
    only,
)


class FunctionDefinition(Strict):
    name: ToolName
    description: str | None = None
    parameters: JSONSchema | None = None
    strict: bool | None = None


class ChatTool(Strict):
    """A tool of ``POST /v1/chat/completions`` (functions: the one kind OpenAI's chat has)."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedChatTool(Strict):
    type: Literal["function"]
    function: FunctionName


ChatToolChoice = Annotated[
    Annotated[ToolMode, Tag("<mode>")] | Annotated[NamedChatTool, Tag("<named>")],
    Discriminator(choice_kind, custom_error_type="tool_choice", custom_error_message=CHOICE_ERROR),
]


class StreamOptions(Strict):
    include_usage: bool = False
    # OpenAI pads delta chunks with random characters when true (its default), against length
    # side channels. This server never pads, so it takes the one value it honours.
    include_obfuscation: (
        Annotated[bool, only(False, "false; this server does not pad chunks")] | None
    ) = None


# What a template is given anyway, or calls: a request's variables may not stand for them
# (vLLM refuses a ``chat_template`` among them: a client's own template would run).
TEMPLATE_OWN_NAMES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "tools",
        "documents",
        "chat_template",
        "raise_exception",
        "strftime_now",
    }
)


def _template_variables(value: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(TEMPLATE_OWN_NAMES.intersection(value))
    if taken:
        raise invalid(
            f"chat_template_kwargs may not give {taken[0]!r}: the template is given it "
            "already, or calls it"
        )
    return value


# Passed on to a relay's upstream as given.
TemplateVariables = Annotated[dict[str, Any], AfterValidator(_template_variables), Finite]


class OpenAIBody(SamplingFields):
    """Fields both OpenAI routes take: honoured, accepted at the one value honoured, or
    accepted and ignored (documented in docs/api.md, as vLLM and llama.cpp do)."""

    unknown_field: ClassVar[Literal["native", "openai"]] = "openai"

    model: str | None = None
    max_tokens: TokenCount | None = None
    stream_options: StreamOptions | None = None
    n: ChoiceCount | None = None
    # Honoured by the built-in models (``sampling.penalize``) and relayed to an upstream.
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    # Token id (as text) -> a bias added to its logit: honoured and relayed likewise.
    logit_bias: Annotated[dict[TokenIdKey, Bias], Field(max_length=MAX_LOGIT_BIASES)] | None = None
    # Who the request is for, and how a provider serves it: relayed as given, ignored by the
    # built-in engines (a prompt cache's key: a relay's routing hint, too).
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> OpenAIBody:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        return self


class ChatBody(OpenAIBody):
    """``POST /v1/chat/completions``."""

    messages: Messages
    # Chat's alone (a legacy completion has none of them, and refuses them as unknown):
    # accepted and ignored, or relayed to a chat upstream as given.
    metadata: Metadata | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    verbosity: str | None = None
    # Relayed to a chat upstream as given; ignored by engines that do not think.
    reasoning_effort: str | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # Relayed to an upstream, which constrains the text; refused by engines that cannot.
    response_format: ChatResponseFormat | None = None
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: ChatToolChoice | None = None
    # vLLM's: the final assistant message is the start of the reply, to be continued.
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    # vLLM's: more variables for the model's chat template (Qwen3's ``enable_thinking``).
    chat_template_kwargs: TemplateVariables | None = None
    # OpenAI's, for features this server lacks: taken at null (or, for ``modalities``, at
    # text alone: what every reply here is), refused otherwise as ``unsupported_parameter``.
    modalities: (
        Annotated[
            list[Literal["text", "audio"]],
            only(["text"], '["text"]; this server makes text, not audio'),
        ]
        | None
    ) = None
    audio: Annotated[Any, only(None, "left out; this server makes text, not audio")] | None = None
    prediction: (
        Annotated[Any, only(None, "left out; this server does not use predicted outputs")] | None
    ) = None
    web_search_options: (
        Annotated[Any, only(None, "left out; this server has no web search")] | None
    ) = None
    functions: (
        Annotated[Any, only(None, "left out; offer functions as tools, as chat does now")] | None
    ) = None
    function_call: (
        Annotated[Any, only(None, "left out; choose a function with tool_choice")] | None
    ) = None
    prompt_cache_retention: PromptCacheRetention | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    moderation: ModerationConfig | None = None

    @model_validator(mode="after")
    def _continued_message_is_the_assistants(self) -> ChatBody:
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                message = "continue_final_message needs the last message to be the assistant's"
                raise invalid(message, "continue_final_message")
            if self.add_generation_prompt:
                message = "continue_final_message and add_generation_prompt cannot both be true"
                raise invalid(message, "add_generation_prompt")
        return self

    @property
    def prefix(self) -> str:
        """The start of the reply the client asked to continue ("" when none)."""
        return self.messages[-1].text if self.continue_final_message else ""

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatBody:
        # OpenAI's old name and its new one for the same limit: given both, and different,
        # either one taken would ignore the other.
        limits = (self.max_tokens, self.max_completion_tokens)
        if None not in limits and limits[0] != limits[1]:
            message = (
                f"max_tokens ({limits[0]}) and max_completion_tokens ({limits[1]}) are the "
                "same limit: give one"
            )
            raise invalid(message, "max_tokens")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatBody:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        return self


def _legacy_prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    # (A list of one int is a prompt of one token id, as ``[[1]]`` is a batch of it.)
    if isinstance(value, list) and value and all(type(v) in (str, int, list) for v in value):
        # OpenAI's other forms (several prompts, token ids): a feature this server lacks,
        # told as such, not as a value no API takes.
        raise PydanticCustomError(
            "not_honoured",
            "must be a string (or a list of one string): this server takes neither several "
            "prompts in one request nor a prompt as token ids",
        )
    if not isinstance(value, str):
        raise invalid("prompt must be a string (or a list of one string)")
    return value


class CompletionBody(OpenAIBody):
    """``POST /v1/completions`` (legacy)."""

    field_codes: ClassVar[Mapping[str, str]] = {"suffix": "unsupported_parameter"}

    prompt: Annotated[str, PlainValidator(_legacy_prompt)]
    logprobs: LegacyLogprobs | None = None
    echo: Annotated[bool, only(False, "false; this server does not echo the prompt")] | None = None
    # OpenAI's range, 0 to 20; this server makes no candidates to choose the best of.
    best_of: (
        Annotated[int, Field(ge=0, le=20), only(1, "1; this server makes no candidates")] | None
    ) = None
    suffix: Annotated[str, only("", "empty; this server does not fill in the middle")] | None = None

    @model_validator(mode="after")
    def _best_of_at_least_n(self) -> CompletionBody:
        # OpenAI's rule: each of the n choices is the best of best_of candidates.
        if self.best_of is not None and self.n is not None and self.best_of < self.n:
            message = f"best_of ({self.best_of}) must be at least n ({self.n})"
            raise invalid(message, "best_of")
        return self
