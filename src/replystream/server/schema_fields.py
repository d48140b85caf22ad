"""The building blocks every request schema is made of: base models, field types, failures.

This file decides the rules a request's fields share: the JSON type (strict: no bool as a
number, no number or string coercion), finite numbers, the ranges a number may take, unknown
fields refused, and the sampling and delivery fields every reply route takes. Each route's
models are built from these beside it (``server.native_schemas``, ``server.openai_schemas``,
``server.responses_schemas``, ``server.anthropic_schemas``, ``server.query_schemas``, and the
chat message they share, ``server.chat_message_schemas``). None of them may know about
aiohttp, engines or the server's configured limits (the prompt limit, the served model's
name): those checks, and checks across fields, are made where a model is turned into a
request (``server.native``, ``server.openai_requests``). Parsing raw bytes into these models,
and turning a failure into the API's error, is ``server.validation``.

Two class attributes of a top-level model steer the error its failures become:
``unknown_field`` (the wording for a field it does not have, its own or a nested object's,
whose code is ``unknown_parameter`` on every route; and whether a missing top-level field is
OpenAI's ``missing_required_parameter``) and ``field_codes`` (a code other than
``invalid_value`` for a field, by its top-level name or its whole path such as
``text.format.type``: ``unsupported_parameter`` for a feature this server lacks; a field
that ``only`` takes at one value says so without it). A third,
``list_params``, names the text parameters of a query string that take several values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
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
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.engine.seeds import MAX_SEED, MIN_SEED
from replystream.server.json_schemas import non_finite_place, schema_problem

MAX_TAG_CHARS = 128
# Union branches are named with these tags; ``validation`` drops them from a field's path.
ITEM_TAGS = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
BLOCK_TAGS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
CHOICE_TAGS = ("mode", "named")
FORMAT_TAGS = ("text", "json_object", "json_schema")
UNION_TAGS = frozenset(
    {
        "<string>",
        "<parts>",
        "<text_part>",
        "<refusal>",
        *(f"<{tag}>" for tag in ITEM_TAGS + BLOCK_TAGS + CHOICE_TAGS + FORMAT_TAGS),
    }
)


def invalid(message: str, param: str | int | None = None) -> PydanticCustomError:
    """A failure whose message is a whole sentence naming the field. ``param`` names the
    field for a check made on the whole object (across fields), whose place is the object;
    an index, the item at fault of a list checked whole."""
    return PydanticCustomError(
        "invalid_field", message, {"param": param} if param is not None else None
    )


def unfit(phrase: str) -> PydanticCustomError:
    """A failure said as what follows the field's name (``must be ...``): the API's error
    puts the field's path before it."""
    return PydanticCustomError("unfit_value", phrase)


def _finite(value: Any) -> Any:
    infinite = non_finite_place(value)
    if infinite is not None:
        where = f" at {infinite}" if infinite else ""
        raise unfit(f"holds a number JSON has not (infinity or NaN){where}")
    return value


# A field that takes any JSON and is passed on (to an upstream, a stored response, a listing):
# the JSON parser reads ``1e999`` as infinity and takes ``NaN``, which would be written on as
# ``Infinity`` and ``NaN``, JSON that strict parsers refuse.
Finite = AfterValidator(_finite)


def only(allowed: object, why: str) -> AfterValidator:
    """Accept a field at the one value this server can honour (the type is checked first):
    another is a feature this server lacks, refused as ``unsupported_parameter``."""

    def check(value: Any) -> Any:
        if value != allowed:
            raise PydanticCustomError("not_honoured", "must be {why}", {"why": why})
        return value

    return AfterValidator(check)


def matching(pattern: str, phrase: str) -> AfterValidator:
    """Accept a string ``pattern`` matches whole; refuse another with ``phrase`` (what follows
    the field's name), which says the rule in words: pydantic's own refusal would quote the
    pattern to the client."""
    rule = re.compile(pattern)

    def check(value: str) -> str:
        if rule.fullmatch(value) is None:
            raise unfit(phrase)
        return value

    return AfterValidator(check)


# Numbers: strict ints (a bool or 1.0 is refused), finite floats (an int is taken as one).
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]
MinTokens = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]
Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]  # int64, as OpenAI's
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
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]  # it divides: 0 is none
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
# A token id, as text (a JSON object's key).
TokenIdKey = Annotated[str, matching("[0-9]{1,9}", "must be a token id: 1 to 9 digits")]
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
    # Text parameters (a query string's) that are lists: each value given repeats the name,
    # bare or with ``[]`` after it (``include[]=a&include[]=b``, as the openai SDKs send one).
    list_params: ClassVar[frozenset[str]] = frozenset()


class Strict(Schema):
    """A JSON request part: strict types, finite numbers, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


def choice_kind(value: Any) -> str | None:
    """A ``tool_choice``'s branch: a mode's name, or an object naming a tool (so an error
    about either names the field, not the other branch's)."""
    if isinstance(value, str):
        return "<mode>"
    if isinstance(value, dict):
        return "<named>"
    return None


# Fields of OpenAI's specification, on chat and Responses alike, for features this server
# lacks. Null asks for nothing, and is taken (clients made from the specification send every
# field, null when unset); any other value is refused as a feature missing, not as an unknown
# field, which OpenAI's own API would never call them.
PromptCacheRetention = Annotated[
    Any, only(None, "left out; this server sets no lifetime for a prompt cache")
]
PromptCacheOptions = Annotated[
    Any, only(None, "left out; this server takes no prompt cache options")
]
ModerationConfig = Annotated[
    Any, only(None, "left out; this server's moderation is the checks it was started with")
]


# OpenAI's ``metadata`` (chat and Responses): at most 16 pairs, keys of at most 64
# characters, values of at most 512.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]
ToolMode = Literal["none", "auto", "required"]
CHOICE_ERROR = "must be 'none', 'auto', 'required' or an object naming a function"


def content_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "<string>"
    if isinstance(value, list):
        return "<parts>"
    return None


# A function's name, as OpenAI and Anthropic both spell the rule.
ToolName = Annotated[
    str,
    matching("[a-zA-Z0-9_-]{1,64}", "must be 1 to 64 letters, digits, underscores or dashes"),
]


def _json_schema(value: Any) -> dict[str, Any]:
    """A JSON Schema (checked against the 2020-12 meta-schema), as a function's parameters."""
    if not isinstance(value, dict):
        raise unfit("must be a JSON Schema object")
    problem = schema_problem(value)
    if problem is not None:
        where, wrong = problem
        raise unfit(f"is not a valid JSON Schema (at {where or 'the top'}: {wrong})")
    return value


JSONSchema = Annotated[dict[str, Any], PlainValidator(_json_schema)]


def _object_schema(value: dict[str, Any]) -> dict[str, Any]:
    if value.get("type") != "object":
        raise unfit('must be a JSON Schema of type "object"')
    return value


ObjectSchema = Annotated[JSONSchema, AfterValidator(_object_schema)]


class SamplingFields(Strict):
    """Sampling and delivery fields every reply route takes (the native ones, and the
    OpenAI routes' replystream extensions)."""

    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    min_tokens: MinTokens | None = None
    ignore_eos: bool | None = None
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
