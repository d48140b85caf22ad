"""The form a reply's text must take (structured outputs): plain text, any JSON object, or
JSON a schema describes; declared in chat's spelling (``response_format``), the Responses
API's (``text.format``, the schema's fields one level up) and Anthropic's
(``output_config.format``: a schema, with no name).

This file decides what each accepts and the one form an engine is given either way
(``GenerationRequest.response_format``: chat's, which a relay sends its upstream as it is;
None for plain text). Whether an engine can honour it is the engine's to say
(``Engine.follows_response_format``). It must not know about aiohttp or engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from replystream.server.schema_fields import FORMAT_TAGS, JSONSchema, Strict, ToolName


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    """Any JSON object (OpenAI's JSON mode)."""

    type: Literal["json_object"]


class SchemaFields(Strict):
    """A schema the text must match, as OpenAI names it: ``name`` (its rule is a function
    name's), ``description``, ``schema`` (checked as a JSON Schema), ``strict``."""

    name: ToolName
    description: str | None = None
    # Aliased: ``schema`` is the name of one of pydantic's own methods.
    json_schema: JSONSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def chat_form(self) -> dict[str, Any]:
        """As chat's ``json_schema`` holds it: the fields given, none added."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude={"type"})


class ChatSchemaFormat(Strict):
    """Chat's ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["json_schema"]
    json_schema: SchemaFields


class ResponsesSchemaFormat(SchemaFields):
    """The Responses API's ``{"type": "json_schema", "name", "schema", ...}``, whose
    ``schema`` is required, as OpenAI's is (chat's may be left out): without one, the
    upstream would be sent a JSON Schema form with no schema to hold the text to."""

    type: Literal["json_schema"]
    json_schema: JSONSchema = Field(alias="schema")


def _format_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return f"<{kind}>" if kind in FORMAT_TAGS else None


_FORMAT_ERROR = Discriminator(
    _format_kind,
    custom_error_type="format_type",
    custom_error_message='must be an object whose type is "text", "json_object" or "json_schema"',
)


class AnthropicSchemaFormat(Strict):
    """Anthropic's ``output_config.format``: ``{"type": "json_schema", "schema": {...}}``,
    always held to exactly (chat's ``strict``)."""

    type: Literal["json_schema"]
    json_schema: JSONSchema = Field(alias="schema")


# The name chat's form needs for a schema Anthropic's gives none.
ANTHROPIC_SCHEMA_NAME = "output"

ChatResponseFormat = Annotated[
    Annotated[TextFormat, Tag("<text>")]
    | Annotated[JSONObjectFormat, Tag("<json_object>")]
    | Annotated[ChatSchemaFormat, Tag("<json_schema>")],
    _FORMAT_ERROR,
]
ResponsesTextFormat = Annotated[
    Annotated[TextFormat, Tag("<text>")]
    | Annotated[JSONObjectFormat, Tag("<json_object>")]
    | Annotated[ResponsesSchemaFormat, Tag("<json_schema>")],
    _FORMAT_ERROR,
]


def engine_format(
    given: TextFormat
    | JSONObjectFormat
    | ChatSchemaFormat
    | ResponsesSchemaFormat
    | AnthropicSchemaFormat
    | None,
) -> Mapping[str, Any] | None:
    """The form an engine is given, chat's, whichever dialect ``given`` came in (None: plain
    text, what every engine makes unasked)."""
    if given is None or isinstance(given, TextFormat):
        return None
    if isinstance(given, JSONObjectFormat):
        return {"type": "json_object"}
    if isinstance(given, AnthropicSchemaFormat):
        schema = {"name": ANTHROPIC_SCHEMA_NAME, "schema": given.json_schema, "strict": True}
        return {"type": "json_schema", "json_schema": schema}
    fields = given.json_schema if isinstance(given, ChatSchemaFormat) else given
    return {"type": "json_schema", "json_schema": fields.chat_form()}
