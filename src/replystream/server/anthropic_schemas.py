"""The declared shape of Anthropic's Messages API requests (``POST /v1/messages`` and its
``count_tokens``): content blocks, tools, tool choice, extended thinking.

This file decides, field by field, what that route accepts, by the same rules as
``server.schema_fields`` (whose building blocks it uses): strict JSON types, ranges, unknown
fields refused, and checks within one object (a block in the role it belongs to, a thinking
budget below ``max_tokens``). Turning a body into a request is ``server.anthropic_api``'s and
``server.tool_requests``'s. It must not know about aiohttp or engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.server.output_formats import AnthropicSchemaFormat
from replystream.server.responses_schemas import ResponsesExtensions
from replystream.server.schema_fields import (
    BLOCK_TAGS,
    Finite,
    ObjectSchema,
    Probability,
    Strict,
    TokenCount,
    ToolName,
    TopK,
    content_kind,
    invalid,
    only,
)


class AnthropicText(Strict):
    """A text content block of an Anthropic message (the only kind this server reads)."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: nothing to cache here
    # The sources an assistant's text cited, as Anthropic's API sends them: sent back as
    # history they are not part of the prompt (this server cites none).
    citations: list[dict[str, Any]] | None = None


AnthropicContent = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[AnthropicText], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of text blocks",
    ),
]


class AnthropicToolUse(Strict):
    """A ``tool_use`` block of an assistant message sent back as history."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: str
    input: Annotated[dict[str, Any], Finite]  # relayed as the call's arguments
    cache_control: dict[str, Any] | None = None
    # Who made the call and the toolset its tool belongs to, as Anthropic's API sends a
    # block (a response saved with the SDK's ``model_dump`` has both, null): they name no
    # part of the call this server relays, so sent back they are not part of the prompt.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class AnthropicToolResult(Strict):
    """A ``tool_result`` block of a user message: what the client's tool returned."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: AnthropicContent | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None  # its call's toolset, as on ``tool_use``: not read

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class AnthropicThinkingBlock(Strict):
    """A ``thinking`` block of an assistant message sent back as history. As Anthropic's
    own API does with an earlier turn's thinking, it is not part of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicRedactedThinking(Strict):
    """A ``redacted_thinking`` block sent back as history (not part of the prompt)."""

    type: Literal["redacted_thinking"]
    data: str


def _block_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"<{kind}>" if kind in BLOCK_TAGS else None


AnthropicBlock = Annotated[
    Annotated[AnthropicText, Tag("<text>")]
    | Annotated[AnthropicToolUse, Tag("<tool_use>")]
    | Annotated[AnthropicToolResult, Tag("<tool_result>")]
    | Annotated[AnthropicThinkingBlock, Tag("<thinking>")]
    | Annotated[AnthropicRedactedThinking, Tag("<redacted_thinking>")],
    Discriminator(
        _block_kind,
        custom_error_type="block_type",
        custom_error_message=(
            "must be a text, tool_use, tool_result, thinking or redacted_thinking block"
        ),
    ),
]

AnthropicBlocks = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[AnthropicBlock], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of content blocks",
    ),
]


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: AnthropicBlocks

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> AnthropicMessage:
        if isinstance(self.content, str):
            return self
        kinds = {block.type for block in self.content}
        if self.role == "user" and "tool_use" in kinds:
            raise invalid("tool_use blocks belong to assistant messages", "content")
        if self.role == "user" and kinds & {"thinking", "redacted_thinking"}:
            raise invalid("thinking blocks belong to assistant messages", "content")
        if self.role == "assistant" and "tool_result" in kinds:
            raise invalid("tool_result blocks belong to user messages", "content")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content if block.type == "text")

    @property
    def ends_in_whitespace(self) -> bool:
        """Whether the message ends with text, and that text with whitespace."""
        if isinstance(self.content, str):
            return self.content[-1:].isspace()
        last = self.content[-1] if self.content else None
        return isinstance(last, AnthropicText) and last.text[-1:].isspace()


ClientToolType = Annotated[
    str, only("custom", '"custom": this server offers client tools, not Anthropic\'s server tools')
]


class AnthropicTool(Strict):
    """A client tool of ``POST /v1/messages`` (Anthropic's server tools are not offered)."""

    # First, so a server tool (``{"type": "web_search_20250305", "name": ...}``) is refused
    # by its type, not by the input_schema it has no need of.
    type: ClientToolType | None = None
    name: ToolName
    input_schema: ObjectSchema
    description: str | None = None
    cache_control: dict[str, Any] | None = None
    # Whether the call's input must match ``input_schema`` exactly: chat's ``strict``, as a
    # relay's upstream is sent it (its grammar holds the arguments to the schema).
    strict: bool | None = None
    # Fine-grained tool streaming: the input streamed as it is made, not buffered. Every
    # fragment goes out as the engine makes it here, whatever this says (Vercel's AI SDK
    # sends ``true`` on every tool of a streamed request by default).
    eager_input_streaming: bool | None = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> AnthropicToolChoice:
        if (self.name is not None) != (self.type == "tool"):
            message = 'tool_choice names a tool exactly when its type is "tool"'
            raise invalid(message, "tool_choice")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            # Anthropic's ``none`` is its type alone, and its API refuses any other field.
            message = 'disable_parallel_tool_use is not taken with tool_choice "none"'
            raise invalid(message, "disable_parallel_tool_use")
        return self


class AnthropicThinking(Strict):
    """``thinking``: whether the message shows a reasoning model's thinking (thinking blocks),
    with Anthropic's checks on the budget. ``adaptive`` (the model decides how much to think,
    with no budget) shows it as ``enabled`` does. ``display`` says how a thinking block
    holds it: ``summarized``, its text (here as the model made it: no summary is made);
    ``omitted``, the blocks with their ``thinking`` empty, as Anthropic's API sends them."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1024, le=MAX_TOKENS_LIMIT)] | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> AnthropicThinking:
        if (self.budget_tokens is not None) != (self.type == "enabled"):
            message = 'thinking.budget_tokens is given exactly when thinking.type is "enabled"'
            raise invalid(message, "budget_tokens")  # named inside ``thinking``'s own place
        if self.display is not None and self.type == "disabled":
            # As Anthropic's types have it: a disabled thinking has nothing to display.
            message = 'thinking.display is given only when thinking.type is not "disabled"'
            raise invalid(message, "display")
        return self


class AnthropicMetadata(Strict):
    user_id: str | None = None


class AnthropicOutputConfig(Strict):
    """``output_config``: how much effort a reasoning model puts in (relayed as chat's
    ``reasoning_effort``; the upstream decides what it takes) and the JSON schema the text
    must match (structured outputs)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AnthropicSchemaFormat | None = None


class MessagesInput(Strict):
    """What a message is made from: the fields ``POST /v1/messages`` and
    ``POST /v1/messages/count_tokens`` share (Anthropic's count takes a message's body without
    the fields that shape only its reply, and refuses those)."""

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: AnthropicContent | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    # Anthropic's automatic prompt caching, for the whole request (a block's own is the same
    # hint): an engine with a prefix cache keeps every prompt's prefix without being asked.
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _content_anthropic_takes(self) -> MessagesInput:
        # Anthropic's API refuses these, in these words (a conversation taken here would be
        # refused there): an empty message other than a final assistant one (an empty
        # prefill), a text block empty or of whitespace alone (a model's reply of blank
        # lines, sent back as a block, is one), and a prefill ending in whitespace.
        last = len(self.messages) - 1
        for number, message in enumerate(self.messages):
            prefill = number == last and message.role == "assistant"
            if not message.content and not prefill:
                raise invalid(
                    f"messages.{number}: all messages must have non-empty content except for "
                    "the optional final assistant message",
                    f"messages[{number}].content",
                )
            blocks = [] if isinstance(message.content, str) else message.content
            for place, block in enumerate(blocks):
                if block.type == "text" and not block.text:
                    raise invalid(
                        f"messages.{number}.content.{place}.text: text content blocks must be "
                        "non-empty",
                        f"messages[{number}].content[{place}].text",
                    )
                if block.type == "text" and block.text.isspace():
                    raise invalid(
                        f"messages.{number}.content.{place}.text: text content blocks must "
                        "contain non-whitespace text",
                        f"messages[{number}].content[{place}].text",
                    )
            if prefill and message.ends_in_whitespace:
                raise invalid(
                    f"messages.{number}: final assistant content cannot end with trailing "
                    "whitespace",
                    f"messages[{number}].content",
                )
        return self

    @model_validator(mode="after")
    def _what_thinking_allows_of_the_input(self) -> MessagesInput:
        """Anthropic's limits on a message's input with thinking on: no forced tool use, and
        no reply begun for the model (a final assistant message). Its API refuses each; a
        count takes the input a message would, so it refuses them as the message does."""
        if not self.thinks:
            return self
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            message = "thinking may not be on when tool_choice forces tool use"
            raise invalid(message, "tool_choice")
        last = len(self.messages) - 1
        if self.messages[last].role == "assistant":
            message = "a reply may not be begun (a final assistant message) when thinking is on"
            raise invalid(message, f"messages[{last}]")
        return self

    @property
    def thinks(self) -> bool:
        """Whether thinking is on (its blocks shown, their text or not)."""
        return self.thinking is not None and self.thinking.type != "disabled"

    @property
    def thinking_text_omitted(self) -> bool:
        """Whether the thinking blocks are sent with their ``thinking`` empty."""
        return self.thinking is not None and self.thinking.display == "omitted"

    @property
    def system_text(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "".join(block.text for block in self.system)


THINKING_TOP_P_MIN = 0.95  # the lowest top_p Anthropic takes with thinking on
NO_THREADS = "absent; this server holds no conversation between requests"


class MessagesExtensions(ResponsesExtensions):
    """replystream's own fields of a message, under ``replystream``: those of a response,
    and ``resumable`` (a stream whose client leaves goes on, to be resumed by its event ids
    at ``GET /v1/replies/{id}/stream``), as on chat. A response has ``background`` and
    ``store`` for that instead."""

    resumable: bool | None = None


class MessagesBody(MessagesInput):
    """``POST /v1/messages`` (Anthropic's Messages API)."""

    # A ``thread`` is refused as Anthropic's API refuses a request it cannot thread, in the
    # code its SDKs read (``server.errors.ANTHROPIC_DETAIL_CODES``).
    field_codes: ClassVar[Mapping[str, str]] = {"thread": "thread_unsupported_request"}

    max_tokens: TokenCount
    temperature: Probability | None = None  # Anthropic's range is 0 to 1
    top_p: Probability | None = None
    top_k: TopK | None = None
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)] | None
    ) = None
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    # Priority capacity, where it is offered, or the standard only: this server has one
    # capacity, which is what either asks for.
    service_tier: Literal["auto", "standard_only"] | None = None
    replystream: MessagesExtensions | None = None
    # Anthropic's conversation held by the server between requests (``{"type": "create"}``,
    # or ``"continue"`` from an earlier message's id): this server holds none. Any thread is
    # refused, whatever its fields, so the SDK's tool runner, which asks for one unless told
    # not to, goes on without it and sends the whole history each turn.
    thread: Annotated[dict[str, Any] | None, only(None, NO_THREADS)] = None

    @model_validator(mode="after")
    def _stops_are_visible(self) -> MessagesBody:
        # Anthropic refuses a stop sequence of whitespace alone (a newline, say), as it does
        # an empty one; an OpenAI stop may be one, so the engine takes it on chat's routes.
        for at, stop in enumerate(self.stop_sequences or ()):
            if not stop.strip():
                message = "each stop sequence must contain non-whitespace"
                raise invalid(message, f"stop_sequences[{at}]")
        return self

    @model_validator(mode="after")
    def _resumable_is_streamed(self) -> MessagesBody:
        if self.replystream is not None and self.replystream.resumable and not self.stream:
            message = "a resumable reply must be streamed (stream: true)"
            raise invalid(message, "replystream.resumable")
        return self

    @model_validator(mode="after")
    def _one_name_each(self) -> MessagesBody:
        # ``replystream.stop`` and ``replystream.top_k`` (taken as on a response) are this
        # API's own ``stop_sequences`` and ``top_k``: given both, one would be ignored.
        extensions = self.replystream
        if extensions is None:
            return self
        if extensions.stop is not None and self.stop_sequences is not None:
            message = "stop_sequences and replystream.stop are the same setting: give one"
            raise invalid(message, "replystream.stop")
        if extensions.top_k is not None and self.top_k is not None:
            message = "top_k and replystream.top_k are the same setting: give one"
            raise invalid(message, "replystream.top_k")
        return self

    @model_validator(mode="after")
    def _what_thinking_allows(self) -> MessagesBody:
        """Anthropic's limits on a message's sampling with thinking on: the model's own
        (``temperature`` 1 only, ``top_p`` from 0.95, no ``top_k``); its input's are
        ``MessagesInput``'s. Its API refuses each; a client that sends one here would be
        refused there."""
        if not self.thinks:
            return self
        if self.temperature is not None and self.temperature != 1:
            raise invalid("temperature may only be set to 1 when thinking is on", "temperature")
        if self.top_p is not None and self.top_p < THINKING_TOP_P_MIN:
            message = f"top_p must be at least {THINKING_TOP_P_MIN} when thinking is on"
            raise invalid(message, "top_p")
        if self.top_k is not None:
            raise invalid("top_k may not be set when thinking is on", "top_k")
        if self.replystream is not None and self.replystream.top_k is not None:
            raise invalid("top_k may not be set when thinking is on", "replystream.top_k")
        return self

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesBody:
        budget = None if self.thinking is None else self.thinking.budget_tokens
        if budget is not None and budget >= self.max_tokens:
            message = "thinking.budget_tokens must be less than max_tokens"
            raise invalid(message, "thinking.budget_tokens")
        return self
