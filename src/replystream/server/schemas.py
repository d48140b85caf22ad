"""Every request's declared shape: bodies, WebSocket messages, query strings, resume cursors.

This file decides what each route accepts, field by field: the JSON type (strict: no bool as
a number, no number or string coercion), the range, and which fields exist at all (unknown
ones are refused, except on the lab's query string, which has always ignored them). It must
not know about aiohttp, engines or the server's configured limits (the prompt limit, the
served model's name): those checks, and checks across fields, are made where a model is
turned into a request (``server.native``, ``server.openai_requests``). Parsing raw bytes into
these models, and turning a failure into the API's error, is ``server.validation``.

Two class attributes of a top-level model steer the error its failures become:
``unknown_field`` (the wording for a field it does not have, its own or a nested object's,
whose code is ``unknown_parameter`` on every route; and whether a missing top-level field is
OpenAI's ``missing_required_parameter``) and ``field_codes`` (a code other than
``invalid_value`` for a field, by its top-level name or its whole path such as
``text.format.type``: ``unsupported_parameter`` for a feature this server lacks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    StringConstraints,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError

from replystream.delivery.policy import (
    BATCH_MS_MAX,
    BATCH_TOKENS_MAX,
    HOLDBACK_TOKENS_MAX,
    KEEPALIVE_S_MAX,
    KEEPALIVE_S_MIN,
)

MAX_TOKENS_LIMIT = 1 << 20
MAX_SEED = 2**63 - 1
MAX_TAG_CHARS = 128
ROLES = ("system", "user", "assistant", "developer", "tool")
# Union branches are named with these tags; ``validation`` drops them from a field's path.
ITEM_TAGS = ("message", "function_call", "function_call_output", "reasoning")
BLOCK_TAGS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
UNION_TAGS = frozenset({"<string>", "<parts>", *(f"<{tag}>" for tag in ITEM_TAGS + BLOCK_TAGS)})


def invalid(message: str, param: str | None = None) -> PydanticCustomError:
    """A failure whose message is a whole sentence naming the field. ``param`` names the
    field for a check made on the whole object (across fields), whose place is the object."""
    return PydanticCustomError("invalid_field", message, {"param": param} if param else None)


def only(allowed: object, why: str) -> AfterValidator:
    """Accept a field at the one value this server can honour (the type is checked first)."""

    def check(value: Any) -> Any:
        if value != allowed:
            raise PydanticCustomError("not_honoured", "must be {why}", {"why": why})
        return value

    return AfterValidator(check)


# Numbers: strict ints (a bool or 1.0 is refused), finite floats (an int is taken as one).
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
OnlyOne = Annotated[int, Field(ge=1, le=1)]
ChoiceCount = Annotated[int, Field(ge=1, le=128)]  # OpenAI's range for n
TopLogprobs = Annotated[int, Field(ge=0, le=20)]  # OpenAI's chat range
LegacyLogprobs = Annotated[int, Field(ge=0, le=5)]  # OpenAI's legacy completions range
BatchTokens = Annotated[int, Field(ge=1, le=BATCH_TOKENS_MAX)]
HoldbackTokens = Annotated[int, Field(ge=0, le=HOLDBACK_TOKENS_MAX)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
BatchMs = Annotated[float, Field(ge=0.0, le=BATCH_MS_MAX)]
KeepaliveS = Annotated[float, Field(ge=KEEPALIVE_S_MIN, le=KEEPALIVE_S_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(ge=0.0, le=10.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]  # a token id, as text
MAX_LOGIT_BIASES = 1024
ClientTag = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TAG_CHARS)]


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= 4
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise invalid("stop must be a non-empty string or a list of up to 4 of them")
    return tuple(value)


Stop = Annotated[tuple[str, ...], PlainValidator(_stop)]


class Schema(BaseModel):
    """A request's declared shape, and how its failures read (see the module's docstring)."""

    unknown_field: ClassVar[Literal["native", "openai"]] = "native"
    field_codes: ClassVar[Mapping[str, str]] = {}


class Strict(Schema):
    """A JSON request part: strict types, finite numbers, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class TextPart(Strict):
    """A chat content part; this server reads text only, so any other type is refused."""

    type: Literal["text"]
    text: str


def content_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "<string>"
    if isinstance(value, list):
        return "<parts>"
    return None


Content = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[TextPart], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of text parts",
    ),
]


# A function's name, as OpenAI and Anthropic both spell the rule.
ToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


def _json_schema(value: Any) -> dict[str, Any]:
    """A JSON Schema (checked against the 2020-12 meta-schema), as a function's parameters."""
    if not isinstance(value, dict):
        raise invalid("must be a JSON Schema object")
    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "the top"
        raise invalid(f"is not a valid JSON Schema (at {where}: {exc.message[:200]})") from None
    return value


JSONSchema = Annotated[dict[str, Any], PlainValidator(_json_schema)]


def _object_schema(value: dict[str, Any]) -> dict[str, Any]:
    if value.get("type") != "object":
        raise invalid('must be a JSON Schema of type "object"')
    return value


ObjectSchema = Annotated[JSONSchema, AfterValidator(_object_schema)]


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


ChatToolChoice = Literal["none", "auto", "required"] | NamedChatTool


class CalledFunction(Strict):
    name: str
    arguments: str


class MessageToolCall(Strict):
    """A tool call an assistant message made (sent back as history)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(Strict):
    """One chat message. ``name`` is passed on to chat upstreams; ``refusal`` is taken only
    as null, the value the OpenAI SDKs send back with an assistant message they received.
    An assistant message may carry ``tool_calls`` (then ``content`` may be null); a ``tool``
    message answers one, naming it in ``tool_call_id``."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Content | None = None
    name: str | None = None
    refusal: None = None
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise invalid("only an assistant message may carry tool_calls", "tool_calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            message = "a tool message needs tool_call_id, and only a tool message has one"
            raise invalid(message, "tool_call_id")
        if self.content is None and self.tool_calls is None:
            raise invalid("content is required (null only beside tool_calls)", "content")
        return self

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


Messages = Annotated[list[Message], Field(min_length=1)]


class SamplingFields(Strict):
    """Sampling and delivery fields every reply route takes (the native ones, and the
    OpenAI routes' replystream extensions)."""

    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    batch_tokens: BatchTokens | None = None
    batch_ms: BatchMs | None = None
    holdback_tokens: HoldbackTokens | None = None
    keepalive_s: KeepaliveS | None = None
    resumable: bool | None = None
    stream: bool | None = None
    upstream_continue: bool | None = None  # a relay may continue the reply elsewhere

    @model_validator(mode="after")
    def _resumable_is_streamed(self) -> SamplingFields:
        if self.resumable and not self.stream:
            raise invalid("a resumable reply must be streamed (stream: true)", "resumable")
        return self


class ReplyBody(SamplingFields):
    """``POST /v1/replies``: exactly one of ``prompt`` and ``messages``."""

    prompt: str | None = None
    messages: Messages | None = None
    max_tokens: TokenCount | None = None
    stream: bool = True
    disconnect: Literal["cancel", "detach"] | None = None

    @model_validator(mode="after")
    def _disconnect_is_for_streams(self) -> ReplyBody:
        if self.disconnect is not None and not self.stream:
            message = "disconnect applies to streamed replies (stream: true)"
            raise invalid(message, "disconnect")
        return self

    @model_validator(mode="after")
    def _detached_replies_are_resumable(self) -> ReplyBody:
        # A detached reply goes on for its client to come back to: one nobody may resume
        # would be generated for nobody (and its log dropped once it ended unread).
        if self.disconnect == "detach" and self.resumable is False:
            message = (
                'disconnect "detach" keeps the reply for its client to resume, which '
                "resumable: false forbids; drop one of them"
            )
            raise invalid(message, "disconnect")
        return self

    @property
    def resumable_asked(self) -> bool | None:
        """Whether the reply is resumable (None: the server's default): ``detach`` makes it
        so, as ``resumable`` makes ``detach`` the default disconnect policy."""
        if self.resumable is None and self.disconnect == "detach":
            return True
        return self.resumable

    @model_validator(mode="before")
    @classmethod
    def _one_prompt(cls, data: Any) -> Any:
        # Before the fields: with both given, which one is bad is beside the point.
        if isinstance(data, dict) and ("prompt" in data) == ("messages" in data):
            raise invalid("give exactly one of prompt or messages", "prompt")
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    # OpenAI pads delta chunks with random characters when true (its default), against length
    # side channels. This server never pads, so it takes the one value it honours.
    include_obfuscation: (
        Annotated[bool, only(False, "false; this server does not pad chunks")] | None
    ) = None


class TextFormat(Strict):
    type: Literal["text"]


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
    # Accepted and ignored.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    # Relayed to a chat upstream as given (chat only); ignored by engines that do not think.
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> OpenAIBody:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        return self


class ChatBody(OpenAIBody):
    """``POST /v1/chat/completions``."""

    field_codes: ClassVar[Mapping[str, str]] = {"response_format": "unsupported_parameter"}

    messages: Messages
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: TextFormat | None = None
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: ChatToolChoice | None = None
    # vLLM's: the final assistant message is the start of the reply, to be continued.
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None

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
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise invalid("prompt must be a string (or a list of one string)")
    return value


class CompletionBody(OpenAIBody):
    """``POST /v1/completions`` (legacy)."""

    field_codes: ClassVar[Mapping[str, str]] = {"suffix": "unsupported_parameter"}

    prompt: Annotated[str, PlainValidator(_legacy_prompt)]
    logprobs: LegacyLogprobs | None = None
    echo: Annotated[bool, only(False, "false")] | None = None
    best_of: OnlyOne | None = None
    suffix: Annotated[str, only("", "empty; this server does not fill in the middle")] | None = None


class InputText(Strict):
    """Text in a Responses message: the client's (``input_text``) or, sent back as history,
    a model's (``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


ResponseContent = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[InputText], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of input_text parts",
    ),
]


class InputMessage(Strict):
    """One message item of a Responses ``input`` (an output item sent back keeps its id and
    status, which are read and not needed)."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: ResponseContent
    id: str | None = None
    status: str | None = None

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


class FunctionCallOutputItem(Strict):
    """A ``function_call_output`` item: what the client's function returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


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


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message")
    return f"<{kind}>" if kind in ITEM_TAGS else None


InputItem = Annotated[
    Annotated[InputMessage, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[ReasoningItem, Tag("<reasoning>")],
    Discriminator(
        _item_kind,
        custom_error_type="item_type",
        custom_error_message=(
            "must be an input item: a message, a function_call, a function_call_output "
            "or a reasoning item"
        ),
    ),
]

ResponseInput = Annotated[
    Annotated[str, Tag("<string>")]
    | Annotated[Annotated[list[InputItem], Field(min_length=1)], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="input_type",
        custom_error_message="must be a string or a non-empty list of input items",
    ),
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


ResponsesToolChoice = Literal["none", "auto", "required"] | NamedFunction


class ResponsesExtensions(Strict):
    """replystream's own fields of a Responses request, under ``replystream`` (a name OpenAI's
    API does not use): sampling the Responses API has no field for, and delivery policies."""

    seed: Seed | None = None
    top_k: TopK | None = None
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
    """``text`` of ``POST /v1/responses``: the output's format (plain text, the one this
    server makes: a JSON schema is refused, as chat's ``response_format`` is) and its
    ``verbosity`` (echoed, as the API does; no engine here takes it)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(Strict):
    """``stream_options`` of ``POST /v1/responses``: as chat's, without ``include_usage``
    (the terminal event always carries the usage)."""

    include_obfuscation: (
        Annotated[bool, only(False, "false; this server does not pad events")] | None
    ) = None


class ResponsesBody(Strict):
    """``POST /v1/responses``."""

    unknown_field: ClassVar[Literal["native", "openai"]] = "openai"
    field_codes: ClassVar[Mapping[str, str]] = {
        "truncation": "unsupported_parameter",
        "text.format.type": "unsupported_parameter",
        "include": "unsupported_parameter",
    }

    model: str | None = None
    input: ResponseInput
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stream: bool = False
    store: bool = True
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    background: bool = False
    previous_response_id: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    service_tier: str | None = None  # accepted and ignored, as on chat
    safety_identifier: str | None = None  # accepted and ignored, as on chat
    prompt_cache_key: str | None = None
    reasoning: ResponsesReasoning | None = None
    stream_options: ResponsesStreamOptions | None = None
    # What the output should carry besides itself (logprobs, encrypted reasoning, ...). This
    # server adds none of it, so it takes the one value it honours: the empty list agent
    # frameworks send when they want nothing more.
    include: (
        Annotated[list[str], only([], "empty; this server adds nothing to the output")] | None
    ) = None
    text: ResponsesText | None = None
    # "auto" would let the server drop input from the middle to fit the context: this one
    # never drops input (a prompt too long is a 400), so it takes the one value it honours.
    truncation: (
        Annotated[str, only("disabled", "disabled; this server never drops input")] | None
    ) = None
    replystream: ResponsesExtensions | None = None

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


class SocketEnvelope(Strict):
    """What a WebSocket message says of itself: its ``type`` and the client's tag ``id``
    (every message but ``auth`` has one). Read first (other fields ignored), so an error
    about the rest can name the tag."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    id: ClientTag | None = None
    type: Any = None


class ReplyMessage(ReplyBody):
    """``{"type": "reply", "id": <tag>, ...}``: the fields of ``POST /v1/replies``."""

    type: Literal["reply"]
    id: ClientTag

    @model_validator(mode="after")
    def _streamed(self) -> ReplyMessage:
        if not self.stream:
            raise invalid("replies over a WebSocket are streamed", "stream")
        return self


class CancelMessage(Strict):
    """``{"type": "cancel", "id": <tag>}``."""

    type: Literal["cancel"]
    id: ClientTag


class AuthMessage(Strict):
    """``{"type": "auth", "api_key": "..."}``: the first message when keys are configured;
    on a server without keys, the caller's key for a relay that passes it on."""

    type: Literal["auth"]
    api_key: str


SocketMessage = ReplyMessage | CancelMessage | AuthMessage

SOCKET_MESSAGES: Mapping[str, type[SocketMessage]] = {
    "auth": AuthMessage,
    "reply": ReplyMessage,
    "cancel": CancelMessage,
}


# Query strings and headers carry text; an integer there is ASCII digits (``int()`` would
# take "²" or "1_000"), parsed only once they are known to be digits.
def _digits(name: str, low: int, high: int, *, blank_is_absent: bool = False) -> BeforeValidator:
    def parse(raw: Any) -> int | None:
        text = raw.strip() if isinstance(raw, str) else ""
        if blank_is_absent and isinstance(raw, str) and not text:
            return None
        if not (text.isascii() and text.isdigit()) or len(text) > 19:
            raise invalid(f"{name} must be an integer from {low} to {high}, got {_cut(raw)}")
        value = int(text)
        if not low <= value <= high:
            raise invalid(f"{name} must be an integer from {low} to {high}, got {value}")
        return value

    return BeforeValidator(parse)


FLAG_ON = ("1", "true", "yes")  # a query flag's spellings, in any case
FLAG_OFF = ("0", "false", "no")


def _flag(name: str) -> BeforeValidator:
    def parse(raw: Any) -> bool:
        word = raw.lower() if isinstance(raw, str) else ""
        if word in FLAG_ON:
            return True
        if word in FLAG_OFF:
            return False
        raise invalid(
            f"{name} must be {', '.join(FLAG_ON)} (on) or {', '.join(FLAG_OFF)} (off), in any "
            f"case; got {_cut(raw)}"
        )

    return BeforeValidator(parse)


def _cut(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


class Query(Schema):
    """A query string's parameters (text; unknown parameters are ignored, as always)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


def _no_lab_tools(raw: Any) -> str:
    raise invalid(
        "the lab routes take no tools: offer them on /v1/chat/completions, /v1/responses "
        "or /v1/messages"
    )


class LabQuery(Query):
    """``GET /wait`` and ``GET /stream``: ``prompt``, ``seed``, ``max_tokens``; ``/stream``
    also ``ids`` and ``resumable`` (None: the server's default)."""

    prompt: str = ""
    seed: Annotated[int, _digits("seed", 0, MAX_SEED)] | None = None
    max_tokens: Annotated[int, _digits("max_tokens", 1, MAX_TOKENS_LIMIT)] | None = None
    ids: Annotated[bool, _flag("ids")] = True
    resumable: Annotated[bool, _flag("resumable")] | None = None
    tools: Annotated[str, PlainValidator(_no_lab_tools)] | None = None


class ResumeCursor(Query):
    """``GET /v1/replies/{id}/stream``: the last event id the client holds, as the query's
    ``last_event_id`` or the ``Last-Event-ID`` header says it (blank or absent: None; how
    the two are reconciled is ``server.context.resume_after``'s)."""

    last_event_id: Annotated[
        int | None, _digits("last_event_id", 0, MAX_SEED, blank_is_absent=True)
    ] = None


class RetrieveQuery(ResumeCursor):
    """``GET /v1/responses/{id}``: the object (``stream`` absent or false), or its events
    after ``starting_after`` (a sequence number; absent: from the first; ``last_event_id``
    is the same cursor)."""

    stream: Annotated[bool, _flag("stream")] = False
    starting_after: Annotated[int, _digits("starting_after", 0, MAX_SEED)] | None = None


class Turn(Strict):
    """One message of a stored conversation (what a Responses request sent, as chat)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class Conversation(Strict):
    """What a stored response keeps in ``ReplyInfo.context``: its conversation so far."""

    messages: list[Turn]
