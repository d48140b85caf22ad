"""The declared shape of query strings and resume cursors: the lab's ``GET /wait`` and
``GET /stream``, a reply's resume point (``last_event_id``, or the ``Last-Event-ID``
header) and its keep-alive interval (``keepalive_s``), ``GET /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and Anthropic's ``GET /v1/models``.

These carry text, not JSON: an integer is ASCII digits in range, a number of seconds digits
with at most one decimal point, a flag one of a few
spellings in any case, and unknown parameters are ignored (as the lab's query string always
has). This file decides what each parameter may be; how the query's cursor and the header
are reconciled is ``server.resume_points.resume_after``'s. It must not know about aiohttp or
engines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from replystream.delivery.policy import KEEPALIVE_S_MAX, KEEPALIVE_S_MIN
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.engine.seeds import MAX_SEED
from replystream.server.schema_fields import Schema, invalid


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


# A number of seconds in a query string: ASCII digits with at most one decimal point, no sign,
# no exponent (``float()`` would take "1e3", "inf", "nan" or " 1_0 "); its range is the field's.
_DECIMAL = re.compile(r"[0-9]{1,12}(?:\.[0-9]{0,12})?|\.[0-9]{1,12}")


def _decimal(name: str) -> BeforeValidator:
    def parse(raw: Any) -> float:
        text = raw.strip() if isinstance(raw, str) else ""
        if _DECIMAL.fullmatch(text) is None:
            raise invalid(f"{name} must be a number of seconds such as 0.5 or 30, got {_cut(raw)}")
        return float(text)

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


# The sampling fields of ``POST /v1/replies`` and the OpenAI routes, which the lab's query does
# not take: ignored like any unknown parameter, a reply would be sampled otherwise than asked.
LAB_UNTAKEN = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "stop",
    "n",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "max_completion_tokens",
)


class LabQuery(Query):
    """``GET /wait`` and ``GET /stream``: ``prompt``, ``seed``, ``max_tokens``; ``/stream``
    also ``ids`` and ``resumable`` (None: the server's default). A sampling field the
    lab does not take (``LAB_UNTAKEN``) is refused, not ignored."""

    @model_validator(mode="before")
    @classmethod
    def _no_other_sampling(cls, raw: Any) -> Any:
        if isinstance(raw, Mapping):
            for name in LAB_UNTAKEN:
                if name in raw:
                    raise invalid(
                        f"the lab routes take no {name} (only prompt, seed and max_tokens): "
                        "ask POST /v1/replies for it",
                        name,
                    )
        return raw

    prompt: str = ""
    seed: Annotated[int, _digits("seed", 0, MAX_SEED)] | None = None
    max_tokens: Annotated[int, _digits("max_tokens", 1, MAX_TOKENS_LIMIT)] | None = None
    ids: Annotated[bool, _flag("ids")] = True
    resumable: Annotated[bool, _flag("resumable")] | None = None
    tools: Annotated[str, PlainValidator(_no_lab_tools)] | None = None


# A resume's ``keepalive_s``: in the range a request's body takes (``schema_fields``).
KeepaliveSeconds = Annotated[
    float, _decimal("keepalive_s"), Field(ge=KEEPALIVE_S_MIN, le=KEEPALIVE_S_MAX)
]


class ResumeCursor(Query):
    """``GET /v1/replies/{id}/stream``: the last event id the client holds, as the query's
    ``last_event_id`` or the ``Last-Event-ID`` header says it (blank or absent: None; how
    the two are reconciled is ``server.resume_points.resume_after``'s); and the keep-alive
    interval this resume asks for, in the range a request's ``keepalive_s`` takes (None:
    the one its reply was asked with, else the server's)."""

    last_event_id: Annotated[
        int | None, _digits("last_event_id", 0, MAX_SEED, blank_is_absent=True)
    ] = None
    keepalive_s: KeepaliveSeconds | None = None


# What ``include`` may name on ``GET /v1/responses/{id}``: the log probabilities a response
# was made with (its text's, when its request included them; ``[]`` otherwise). Not named,
# the object shows none (each ``output_text`` part's ``logprobs`` is ``[]``), as OpenAI's
# retrieve adds only what its ``include`` names.
RETRIEVE_INCLUDE = "message.output_text.logprobs"


def _retrieve_include(raw: Any) -> str:
    if raw == RETRIEVE_INCLUDE:
        return str(raw)
    raise PydanticCustomError(
        "not_honoured",
        "may hold only {taken}: a response here has no other output to add; got {value}",
        {"value": _cut(raw), "taken": RETRIEVE_INCLUDE},
    )


def _no_obfuscation(raw: bool) -> bool:
    if raw:
        raise PydanticCustomError(
            "not_honoured", "must be false; this server does not pad events", {}
        )
    return raw


class RetrieveQuery(ResumeCursor):
    """``GET /v1/responses/{id}``: the object (``stream`` absent or false), or its events
    after ``starting_after`` (a sequence number, from 0; absent: from the first), or after
    ``last_event_id`` (an event's SSE ``id:``, the sequence number plus one), kept alive at
    ``keepalive_s`` (a stream's alone, as the cursors are). ``include``
    and ``include_obfuscation``, which the SDKs send from OpenAI's spec of this route, are
    taken at what this server does, as ``POST /v1/responses`` takes them: another value is
    a 400, not ignored. ``include`` decides what the object shows, and is refused with
    ``stream`` (``responses_api.handle_retrieve``): a stream replays its events as made."""

    field_codes: ClassVar[Mapping[str, str]] = {"include": "unsupported_parameter"}
    list_params: ClassVar[frozenset[str]] = frozenset({"include"})

    stream: Annotated[bool, _flag("stream")] = False
    starting_after: Annotated[int, _digits("starting_after", 0, MAX_SEED)] | None = None
    include: tuple[Annotated[str, PlainValidator(_retrieve_include)], ...] = ()
    include_obfuscation: Annotated[
        bool, _flag("include_obfuscation"), AfterValidator(_no_obfuscation)
    ] = False


# OpenAI's values of ``include`` (its ``IncludeEnum``), and those of them that apply to the
# input items this server keeps (a reasoning item's encrypted content; the log probabilities
# of a model's text sent back): the others name output this server never makes (search
# results, images, code outputs).
OPENAI_INCLUDES = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
)
INPUT_ITEMS_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")
INPUT_ITEMS_PAGE_MAX = 100  # OpenAI's range for ``limit``: 1 to 100, 20 by default


def _input_items_include(raw: Any) -> str:
    if raw in INPUT_ITEMS_INCLUDES:
        return str(raw)
    taken = ", ".join(INPUT_ITEMS_INCLUDES)
    if raw in OPENAI_INCLUDES:
        raise PydanticCustomError(
            "not_honoured",
            "{value} adds nothing to the input items this server keeps; it takes {taken}",
            {"value": raw, "taken": taken},
        )
    raise PydanticCustomError(
        "not_honoured",
        "must be one of OpenAI's include values, and this server takes {taken}; got {value}",
        {"value": _cut(raw), "taken": taken},
    )


class InputItemsQuery(Query):
    """``GET /v1/responses/{id}/input_items``: a page of the response's input items, in
    ``order`` (``asc``: as the request gave them; ``desc``, the default: last first), after
    the item ``after`` and before the item ``before`` (their ids), at most ``limit``; and
    what to ``include`` (a list: ``include[]=...``, as the SDKs send it)."""

    field_codes: ClassVar[Mapping[str, str]] = {"include": "unsupported_parameter"}
    list_params: ClassVar[frozenset[str]] = frozenset({"include"})

    after: str | None = None
    before: str | None = None
    limit: Annotated[int, _digits("limit", 1, INPUT_ITEMS_PAGE_MAX)] = 20
    order: Literal["asc", "desc"] = "desc"
    include: tuple[Annotated[str, PlainValidator(_input_items_include)], ...] = ()


ANTHROPIC_MODELS_PAGE_MAX = 1000  # Anthropic's range for ``limit``: 1 to 1000, 20 by default


# Anthropic's lifecycle stages of a model, and how many its filter may name.
LIFECYCLE_STAGES = ("active", "deprecated", "retired")
LIFECYCLE_DEFAULT = ("active", "deprecated")  # retired models only when asked for


def _lifecycle_stage(raw: Any) -> str:
    if raw in LIFECYCLE_STAGES:
        return str(raw)
    raise PydanticCustomError(
        "not_a_stage",
        "must be one of {stages}; got {value}",
        {"value": _cut(raw), "stages": ", ".join(LIFECYCLE_STAGES)},
    )


class AnthropicModelsQuery(Query):
    """``GET /v1/models`` asked by an Anthropic client: a page of at most ``limit`` models,
    those after the model ``after_id`` and before the model ``before_id``, of the
    ``lifecycle`` stages named (a list: ``lifecycle[]=...``, as the SDK sends it; up to 3, as
    Anthropic's API takes them; none: its default, active and deprecated)."""

    list_params: ClassVar[frozenset[str]] = frozenset({"lifecycle"})

    after_id: str | None = None
    before_id: str | None = None
    limit: Annotated[int, _digits("limit", 1, ANTHROPIC_MODELS_PAGE_MAX)] = 20
    lifecycle: Annotated[
        tuple[Annotated[str, PlainValidator(_lifecycle_stage)], ...], Field(max_length=3)
    ] = LIFECYCLE_DEFAULT
