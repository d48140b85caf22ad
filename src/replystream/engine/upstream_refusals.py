"""What an upstream's answer before its body means, as our errors: an attempt that ends
before it has a stream ends with one of these.

This file names those errors, ``UpstreamUnavailable`` (502: no upstream answered, or not as
one should) and ``UpstreamTimeout`` (504: no response head within the head timeout), which
the engine raises for a failed connection (``upstream_errors`` words it), and decides what a
status other than 200 means: an upstream 4xx about the request is a ``RequestRejected``
(400) carrying the upstream's message and the field it names (of the chat request it was
sent: ``names_upstream_field``), a ``ContextTooLong`` when its words say the request is past
the model's context (``context_length_exceeded``, as the built-in engines say it: a model of
a longer context may take it), or an ``OwnFieldRefused`` when the field is one as the relay
writes it (``stream_options``, ``max_tokens``: the engine sends the request again as the
upstream asks); a 413 says the upstream's limit on a request's size
(``UpstreamTooLarge``, 413: another upstream may take it); a 404 that speaks of a model says
the upstream does not serve the model (``UpstreamModelNotFound``, 404: about that model
there, not the upstream's health), one that does not, that its URL lacks the path (502,
most often no /v1), but for a route beside chat (``/completions``, ``/embeddings``), where
it and a 405 or 501 say the upstream serves chat alone (``UpstreamLacksRoute``, 404, not
its health either); 429 and 503 stay overload (``UpstreamOverloaded``, 503) with the wait
the upstream asked for (``Retry-After``, at most a cool-down), which its circuit honours; an
upstream passed the caller's own key that refuses it (401, 403) or rate-limits it (429)
answers the client as it is, not failed over (``UpstreamRefusedClientKey``,
``UpstreamLimitedClientKey``); 401 or 403 to our own key is our configuration's fault (502,
naming where that key is configured), as is a redirect (502, naming where it points: its URL
is to be fixed, not followed), and so is a TLS front's refusal of the relay's own connection
(``front_refusal``: 502, ``upstream_tls``, so another upstream is tried): each an
``UpstreamMisconfigured``, which no retry mends until an operator does. Every message is
ours; an upstream's own words appear only quoted, from a JSON error body, and never with a
key of ours in them (some upstreams repeat the key they refused). Whether another upstream
is tried is ``upstream_attempts``'s. It must not know how a request is built, how an
upstream is picked, or about our HTTP server.
"""

from __future__ import annotations

import ast
import asyncio
import re
import time
from collections.abc import Sequence

from pydantic_core import from_json

from replystream.engine.base import EngineError, RequestRejected
from replystream.engine.upstream_errors import PLAIN_TO_TLS, quoted
from replystream.engine.upstream_http_connection import Response
from replystream.engine.upstream_proxy import CREDENTIALS_ASKED
from replystream.retry_after import retry_after_s

CHAT_PATH = "/chat/completions"  # the route every upstream serves (after its base URL)
BODY_LIMIT = 64 * 1024  # bytes of an upstream error body we read to quote its message
# The longest wait a caller is told when an upstream rate-limited its own key: a day, the
# longest window a hosted API's quota resets over; a longer one is a broken header.
CLIENT_WAIT_LIMIT_S = 86_400.0


class UpstreamUnavailable(EngineError):
    """No upstream answered: connection refused, reset, or a broken response head (502)."""

    status = 502


class UpstreamMisconfigured(UpstreamUnavailable):
    """An upstream refused the relay for what the relay's configuration says of it: the key
    sent (401, 403), a proxy's credentials (407), its URL (a redirect, a path it lacks, http
    to a TLS port), a CA that does not trust its certificate. Until an operator edits it,
    every attempt there fails the same way."""

    lasting = True


class OutOfResources(EngineError):
    """This server ran out of file descriptors (or memory) for a connection to an upstream:
    its own shortage, which says nothing of the upstream (no circuit counts it). 503: it may
    pass as soon as other connections close."""

    status = 503


class UpstreamTimeout(EngineError):
    """An upstream took longer than the head timeout to connect or answer (504)."""

    status = 504


class UpstreamOverloaded(EngineError):
    """An upstream answered 429 or 503 (503 to our client: try again later). Its
    ``retry_after_s`` is the wait the upstream asked for (at most a cool-down); once the
    relay gives up, when some upstream may take a request."""

    status = 503


class UpstreamLacksRoute(EngineError):
    """An upstream has no route for a request beside chat (``/completions``,
    ``/embeddings``): a 404 that names no model, a 405, or llama.cpp's server's 501 for
    embeddings it was not started to make. Some upstreams serve chat alone (most hosted
    OpenAI-compatible APIs lack the legacy completions route), so it says what the upstream
    serves, not its health: another upstream may take the request, and none counts it on its
    circuit (404 to the client when none is left)."""

    status = 404


class UpstreamModelNotFound(EngineError):
    """An upstream answered 404 naming a model: it serves no model by the name sent (a
    typo in a routes file's ``models``, a model it unloaded). That says something of the
    model at that upstream, not of the upstream's health: another upstream serving the
    model may take the request, and none counts it on its circuit."""

    status = 404


class OwnFieldRefused(RequestRejected):
    """An upstream's 400 or 422 refusing a field as the relay itself writes it (``field``):
    ``stream_options``, added to every request for the upstream's own usage, which some
    upstreams refuse (Azure OpenAI's API versions before 2024-10-21; servers whose schema
    forbids a field they do not know); or ``max_tokens``, the relay's spelling of the
    client's token limit, where the model takes only ``max_completion_tokens`` (OpenAI's
    reasoning models); or ``content``, a message's null content (an assistant's turn of tool
    calls with no text), where the upstream's schema takes a string only (llama-cpp-python's).
    Not the client's mistake: the engine sends the request again as the
    upstream asks."""

    def __init__(self, message: str, *, field: str, code: str, param: str | None) -> None:
        super().__init__(message, code=code, param=param, names_upstream_field=True)
        self.field = field


# Words that refuse a field named beside them: "Unrecognized request argument supplied:
# stream_options" (Azure OpenAI's older API versions), "Unknown parameter: 'stream_options'."
# (OpenAI's), "stream_options is not supported", "Invalid value for stream_options". The gap
# between them may hold no ``{`` or ``=``: a validation error that echoes the whole request
# (pydantic's ``input_value={...}``, as vLLM's 400 for a model-level check quotes it) names
# the field without refusing it.
_REFUSING = (
    r"(?:unrecogni[sz]ed|unknown|unsupported|unexpected|invalid|extra|forbidden"
    r"|not (?:allowed|permitted|supported|recogni[sz]ed))"
)


def _refused(field: str) -> re.Pattern[str]:
    """Words that refuse ``field``, before or after its name."""
    return re.compile(
        rf"\b{_REFUSING}\b[^{{=\n]{{0,40}}\b{field}\b|\b{field}\b[^{{=\n]{{0,30}}\b{_REFUSING}\b",
        re.IGNORECASE,
    )


_STREAM_OPTIONS_REFUSED = _refused("stream_options")
_MAX_TOKENS_REFUSED = _refused("max_tokens")
# A message's null content refused where only a string is taken: llama-cpp-python's schema
# (0.3.36) has an assistant's content a string or absent, where OpenAI's API takes null beside
# tool calls, as the relay writes the turn of an Anthropic ``tool_use`` block or a Responses
# ``function_call`` item ("messages.1.ChatCompletionRequestAssistantMessage.content: Input
# should be a valid string", the first problem of the kind its role names).
_NULL_CONTENT_REFUSED = re.compile(
    r"^messages\.\d+\.(?:\w+\.)?content: Input should be a valid string"
)


def own_field_refused(param: str | None, message: str | None) -> str | None:
    """Which field as the relay writes it an upstream's 400 or 422 refuses, by its ``param``
    and its words (None: none of ours). ``content`` is a message's null content where the
    upstream takes a string only (llama-cpp-python's). ``max_tokens`` is refused where the
    words say so and name ``max_completion_tokens`` ("Unsupported parameter: 'max_tokens' is
    not supported with this model. Use 'max_completion_tokens' instead."), not where they only
    name both (vLLM's "'max_tokens' or 'max_completion_tokens' is too large", a limit past the
    context)."""
    said = message or ""
    if param == "stream_options" or _STREAM_OPTIONS_REFUSED.search(said):
        return "stream_options"
    if _MAX_TOKENS_REFUSED.search(said) and "max_completion_tokens" in said:
        return "max_tokens"
    if _NULL_CONTENT_REFUSED.match(said):
        return "content"
    return None


class ContextTooLong(RequestRejected):
    """An upstream's 400 or 422 saying the request (its prompt, or the prompt and its token
    limit together) is past the model's context: the client's to shorten, or a fallback
    model's of a longer context to take (``upstream_attempts``)."""

    def __init__(self, message: str, *, param: str | None) -> None:
        super().__init__(
            message, code="context_length_exceeded", param=param, names_upstream_field=True
        )


# How upstreams say a request is past the model's context: OpenAI's code
# ``context_length_exceeded`` ("This model's maximum context length is 128000 tokens"), vLLM's
# "maximum context length is 4096 tokens" (of the prompt, or of "'max_tokens' or
# 'max_completion_tokens' is too large"), SGLang's "longer than the model's context length",
# llama.cpp's "the request exceeds the available context size", Mistral's "too large for model
# with 32768 maximum context length", TGI's "`inputs` tokens + `max_new_tokens` must be <=
# 4096" and "`inputs` must have less than 4096 tokens", and Anthropic's "prompt is too long"
# (through proxies that pass it on).
_CONTEXT_EXCEEDED = re.compile(
    r"\bcontext (?:length|size|window|limit)\b"
    r"|maximum context length"
    r"|`inputs` tokens \+ `max_new_tokens` must be"
    r"|`inputs` must have less than \d+ tokens"
    r"|\bprompt is too long\b",
    re.IGNORECASE,
)


def context_exceeded(code: str | None, message: str | None) -> bool:
    """Whether an upstream's 400 or 422 says the request is past the model's context."""
    return code == "context_length_exceeded" or bool(_CONTEXT_EXCEEDED.search(message or ""))


class UpstreamTooLarge(EngineError):
    """An upstream answered 413: the request is larger than it (or a proxy in front of it)
    takes. Its limit, not the request's validity nor the upstream's health: another upstream
    may take it, and none counts it on its circuit; with none left, the client's 413."""

    status = 413


class UpstreamRefusedClientKey(RequestRejected):
    """An upstream refused the caller's own key, passed on to it: its 401 or 403 goes to our
    client as it is (the key is the client's to fix, so no other upstream is tried)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message, code="upstream_refused_client_key")
        self.status = status


class UpstreamLimitedClientKey(RequestRejected):
    """An upstream rate-limited the caller's own key, passed on to it (its 429: that
    account's quota or rate, not the upstream's load): the client's, not failed over."""

    status = 429

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message, code="upstream_rate_limited", retry_after_s=retry_after_s)


def _upstream_message(
    raw: bytes, withheld: Sequence[str]
) -> tuple[str | None, str | None, str | None]:
    """Message, code and param of an upstream's JSON error body (any of the common shapes);
    no message for a body that is not one (an HTML page, a proxy's text, nothing). None of
    them repeats a key of ``withheld``: the message has each one out, and a code or param
    that holds one is dropped."""
    try:
        body = from_json(raw)  # its nesting bounded (a ValueError), where json.loads recurses
    except ValueError:
        return None, None, None
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict) and isinstance(error.get("message"), dict):
        error = error["message"]  # Mistral's: a FastAPI error inside its own
    if isinstance(error, dict) and isinstance(error.get("detail"), list):
        return _validation_detail(error["detail"], withheld)
    if isinstance(error, dict):
        code, param = error.get("code"), error.get("param")
        message = error.get("message") or error.get("detail")
        return (
            quoted(message, withheld=withheld)
            if isinstance(message, str) and message.strip()
            else None,
            _keyless(code, withheld),
            _keyless(param, withheld),
        )
    if isinstance(error, str) and error.strip():
        return quoted(error, withheld=withheld), None, None
    return None, None, None


def _validation_detail(
    detail: list[object], withheld: Sequence[str]
) -> tuple[str | None, str | None, str | None]:
    """Message and param of a FastAPI validation error (a 422 whose ``detail`` lists each
    problem: ``{"loc": ["body", "stream_options"], "msg": "Extra inputs are not permitted"}``;
    Mistral's API sends it as its error's ``message``), the first problem's. The ``input``
    each problem repeats (the request's own values) is not quoted."""
    first = detail[0] if detail else None
    if not isinstance(first, dict) or not isinstance(first.get("msg"), str):
        return None, None, None
    loc = first.get("loc")
    where = [str(part) for part in loc] if isinstance(loc, list) else []
    if where[:1] == ["body"]:
        where = where[1:]
    said = f"{'.'.join(where)}: {first['msg']}" if where else first["msg"]
    param = _keyless(where[0], withheld) if where else None
    return quoted(said, withheld=withheld), None, param


# How llama-cpp-python's server (0.3.36) answers a request its schema refuses: not FastAPI's
# 422, but a 500 whose message is the validation error as Python prints it, each problem on a
# line of its own, the request's own values among them ("1 validation error:\n  {'type':
# 'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg': "Input should be
# 'text' or 'json_object'", 'input': 'json_schema', ...}"), and where in its code it failed.
_PRINTED_VALIDATION = re.compile(r"\d+ validation errors?:\n")
_PRINTED_PROBLEM = re.compile(
    r"\{'type': '(?P<type>[a-z_]+)', 'loc': \((?P<loc>'body'(?:, (?:'[^'\\\n]*'|\d+))*)\), "
    r"'msg': (?P<msg>'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")"
)


def _printed_validation(
    raw: bytes, withheld: Sequence[str]
) -> tuple[str | None, str | None, str | None] | None:
    """Message and param of the first problem of a validation error of the request's body
    printed as an error's message (llama-cpp-python's 500), as ``_validation_detail`` gives
    them for FastAPI's 422: the field and its words, no value of the request's; None for any
    other answer. Of a message checked against each kind of message, the first problem of
    the kind its role names, where there is one."""
    try:
        body = from_json(raw)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not _PRINTED_VALIDATION.match(message):
        return None
    problems = [
        (found["type"], ast.literal_eval(f"({found['loc']},)"), ast.literal_eval(found["msg"]))
        for found in _PRINTED_PROBLEM.finditer(message)
    ]
    if not problems:
        return None
    # A message is checked against each kind of message (a union): a kind whose role it does
    # not have is no kind it meant, and its other problems say nothing of it.
    other_kinds = [
        loc[:-1] for kind, loc, _ in problems if kind == "literal_error" and loc[-1] == "role"
    ]
    meant = [p for p in problems if not any(p[1][: len(k)] == k for k in other_kinds)]
    _, loc, msg = (meant or problems)[0]
    return _validation_detail([{"loc": list(loc), "msg": msg}], withheld)


# llama-cpp-python's server started without ``--embedding`` answers its embeddings route with
# a 500 saying so: a route it lacks, as llama.cpp's own server's 501 says.
_NO_EMBEDDINGS = "must be created with embedding=True"


# The longest code or param passed on: OpenAI's and the servers' are a word or a field's
# path; anything longer is no code a client matches on, and is not repeated.
NAME_MAX = 100


def _keyless(value: object, withheld: Sequence[str]) -> str | None:
    """``value`` if it is a string, no longer than ``NAME_MAX``, that holds no key of
    ``withheld``."""
    if (
        isinstance(value, str)
        and len(value) <= NAME_MAX
        and not any(key in value for key in withheld)
    ):
        return value
    return None


# What nginx, the usual TLS front of a model server, answers (as a 400 with a page of its own:
# its codes 495, 496 and 497), and Go's HTTP servers (Caddy, Traefik) to plain HTTP, when the
# connection, not the request, is wrong: the words of each page, and ours for it.
_FRONT_REFUSALS = (
    (
        b"No required SSL certificate was sent",
        "it asks for a client certificate, and this relay shows none (cert_file and key_file"
        " in the routes file)",
    ),
    (
        b"The SSL certificate error",
        "it refused the client certificate this relay shows (is it signed by a CA the"
        " upstream trusts, and still valid?)",
    ),
    (b"The plain HTTP request was sent to HTTPS port", PLAIN_TO_TLS),
    (b"Client sent an HTTP request to an HTTPS server", PLAIN_TO_TLS),
)


def front_refusal(status: int, raw: bytes) -> str | None:
    """What a TLS front's 400 refusing the relay's own connection says (a client certificate
    missing or refused, plain HTTP to its HTTPS port), in words that follow the upstream's
    name; None for any other answer. Such a refusal is the relay's configuration, never the
    client's request, whatever its status says."""
    if status != 400:
        return None
    for page, words in _FRONT_REFUSALS:
        if page in raw:
            return words
    return None


def redirected(location: str, withheld: Sequence[str]) -> str:
    """What a 3xx means, in words that follow the upstream's name: the relay follows no
    redirect (a 301 or 302 would lose a request's body, and another origin would be sent
    this upstream's key and certificate), so its URL in the configuration is what to fix."""
    where = f"it redirects to {quoted(location, withheld=withheld)}" if location else "it redirects"
    return f"{where}, and the relay follows no redirect: configure the URL it points to"


def our_key_refused(key_from: str | None) -> str:
    """What a 401 or 403 to our own key means, in words that follow the upstream's name: the
    operator is sent where that key is configured (``key_from``), or told none is."""
    if key_from is None:
        return "it wants an API key, and none is configured for it"
    return f"it refused our API key, set by {key_from}"


async def refusal(
    response: Response,
    backend: str,
    client_key: str | None,
    *,
    passes_key: bool,
    key_from: str | None,
    withheld: Sequence[str],
    read_s: float,
    cooldown_s: float,
    path: str = CHAT_PATH,
) -> EngineError:
    """What ``backend``'s answer other than 200 to ``POST {backend}{path}`` means for the
    attempt: its body (at most
    ``BODY_LIMIT`` bytes, read for at most ``read_s``) quoted in our error, without the keys
    of ``withheld``, the response closed. ``passes_key``: the upstream is sent the caller's
    own key (``client_key``), else the key configured where ``key_from`` says (None: none);
    ``cooldown_s``: the longest an overloaded upstream's wait keeps its circuit open."""
    try:
        async with asyncio.timeout(read_s):
            raw = await response.read(BODY_LIMIT)
    except TimeoutError:
        raw = b""
    finally:
        response.close()
    message, code, param = _upstream_message(raw, withheld)
    status = response.status
    where = f"the upstream at {backend} answered {status}"
    front = front_refusal(status, raw)
    if front is not None:
        return UpstreamMisconfigured(f"{where}: {front}", code="upstream_tls")
    said = f"{where}: {message}" if message else where
    if status == 413:  # a proxy's page, most often, with no message: nginx takes 1 MB at most
        if not message:
            said = f"{where}: the request is larger than it takes (its own limit, or a proxy's)"
        return UpstreamTooLarge(said, code="request_too_large")
    printed = _printed_validation(raw, withheld) if status == 500 else None
    if printed is not None:
        # The request, refused by the upstream's schema (llama-cpp-python's 500 for it): the
        # client's to change, as a 422 is, and no failure of the upstream's to count.
        message, code, param = printed
        said = f"the upstream at {backend} refused the request: {message}"
    if status in (400, 422) or printed is not None:
        if context_exceeded(code, message):
            return ContextTooLong(said, param=param)
        field = own_field_refused(param, message)
        if field is not None:
            return OwnFieldRefused(said, field=field, code=code or "upstream_rejected", param=param)
        return RequestRejected(
            said, code=code or "upstream_rejected", param=param, names_upstream_field=True
        )
    no_route = status == 404 and (message is None or "model" not in message.lower())
    lacks = status in (405, 501) or (status == 500 and _NO_EMBEDDINGS in (message or ""))
    if path != CHAT_PATH and (no_route or lacks):
        said = f"{where} to POST {path}: it has no such route"
        said += f" ({message})" if message else ""
        return UpstreamLacksRoute(said, code="route_unsupported")
    if no_route:
        # No word of a model: the path is what it lacks (a framework's "Not Found", nginx's
        # page), most often a base URL without its /v1. That upstream serves nothing so: its
        # failure, counted on its circuit, another upstream tried.
        said = f"{where} to POST {backend}{path}: it has no such path"
        said += f" ({message})" if message else ""
        return UpstreamMisconfigured(
            f"{said}; does its URL end in /v1?", code="upstream_error_status"
        )
    if status == 404:
        # It says the model is what it lacks (vLLM's, Ollama's and OpenAI's words all name
        # it). Counted on its circuit, one bad name would take it out for every model it
        # does serve.
        said = f"{where} to POST {path}: it does not serve the model sent to it"
        if message:
            said += f" ({message})"
        return UpstreamModelNotFound(said, code="model_not_found")
    if status == 429 and passes_key:
        # The caller's own account's limit: another upstream would not lift it, and
        # counted on the circuit, one caller's spent quota would shut out every caller.
        # When it lifts is the caller's to know: the upstream's wait goes on to it.
        wait = retry_after_s(response.retry_after, time.time(), CLIENT_WAIT_LIMIT_S)
        return UpstreamLimitedClientKey(said, retry_after_s=wait)
    if status in (429, 503):
        # Its circuit stays open for as long as it asks, but no longer than a cool-down:
        # the operator's bound on how long any upstream is left out (a wrong clock or a
        # broken header must not take one out for hours; if it is still busy then, its
        # trial says so and it asks again).
        wait = retry_after_s(response.retry_after, time.time(), cooldown_s)
        return UpstreamOverloaded(said, code="upstream_overloaded", retry_after_s=wait)
    if status in (401, 403) and passes_key:
        # The client's own key: theirs to fix, and no other upstream would take it.
        said = f"{where}: it refused the API key you sent, which is passed on to it"
        if not client_key:
            said = f"{where}: it wants an API key, and you sent none to pass on"
        return UpstreamRefusedClientKey(said, status=status)
    if status == 407:  # a proxy's, on the way to an http upstream: our configuration too
        said = f"{where}: {CREDENTIALS_ASKED}"
    elif status in (401, 403):  # our configuration, not the client's request
        said = f"{where}: {our_key_refused(key_from)}"
    elif 300 <= status < 400:  # our configuration too: its URL
        said = f"{where}: {redirected(response.location, withheld)}"
    else:
        return UpstreamUnavailable(said, code="upstream_error_status")
    return UpstreamMisconfigured(said, code="upstream_error_status")
