"""The chat message, as OpenAI's chat API spells it: text content, the tool calls an
assistant made, a tool's answer to one.

``POST /v1/replies`` and ``POST /v1/chat/completions`` take a list of these, and a stored
response keeps its conversation's tool calls in this shape (``server.responses_schemas``).
This file decides what one message may hold (tool calls only on an assistant message,
``tool_call_id`` only on a tool's, null content only beside tool calls). It must not know
about routes, aiohttp or engines.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from replystream.server.schema_fields import Strict, content_kind, invalid


class TextPart(Strict):
    """A chat content part; this server reads text only, so any other type is refused."""

    type: Literal["text"]
    text: str


Content = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[TextPart], Tag("<parts>")],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or a list of text parts",
    ),
]


class CalledFunction(Strict):
    name: str
    arguments: str
    # The OpenAI SDK's stream and parse helpers add the arguments as parsed: sent back with
    # the call, it says nothing ``arguments`` does not.
    parsed_arguments: Any = None


class MessageToolCall(Strict):
    """A tool call an assistant message made (sent back as history). The OpenAI SDK's stream
    helper keeps each call's ``index`` from the chunks it was assembled from."""

    id: str
    type: Literal["function"]
    function: CalledFunction
    index: int | None = None


class Message(Strict):
    """One chat message. ``name`` is passed on to chat upstreams. An assistant message may
    carry ``tool_calls`` (then ``content`` may be null); a ``tool`` message answers one,
    naming it in ``tool_call_id``.

    An assistant message the OpenAI SDK received and is sent back as history carries the
    reply's other fields too, as OpenAI's API takes them: ``refusal`` (a model's refusal to
    answer, relayed: then ``content`` may be null, and the refusal's words are the message's
    text to an engine that reads text), ``audio`` and the deprecated ``function_call`` as
    null (this server makes none of them), ``annotations`` (the reply's citations, not part
    of the prompt), and the parse helpers' ``parsed`` (the content, parsed). A reasoning
    model's thinking, as this server gives it (``reasoning_content``, DeepSeek's spelling)
    or as vLLM and OpenRouter do (``reasoning``), comes back on the assistant message it was
    given with (Vercel's AI SDK sends it back so): taken and, as a thinking block or a
    reasoning item sent back on the other routes, no part of the prompt."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Content | None = None
    name: str | None = None
    refusal: str | None = None
    audio: None = None
    function_call: None = None
    annotations: list[dict[str, Any]] | None = None
    parsed: Any = None
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise invalid("only an assistant message may carry tool_calls", "tool_calls")
        for thought in ("reasoning_content", "reasoning"):
            if getattr(self, thought) is not None and self.role != "assistant":
                raise invalid(f"only an assistant message may carry {thought}", thought)
        if (self.tool_call_id is None) == (self.role == "tool"):
            message = "a tool message needs tool_call_id, and only a tool message has one"
            raise invalid(message, "tool_call_id")
        if self.refusal is not None and self.role != "assistant":
            raise invalid("only an assistant message may carry a refusal", "refusal")
        if self.content is None and self.tool_calls is None and self.refusal is None:
            raise invalid(
                "content is required (null only beside tool_calls or a refusal)", "content"
            )
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Messages = Annotated[list[Message], Field(min_length=1)]
