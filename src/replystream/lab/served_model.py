"""Which model to name in an OpenAI-compatible request when the user named none.

This file decides where a chat or completions URL lists its models (``GET .../v1/models``,
beside the endpoint, as the OpenAI API places them) and which one to use: the only one listed.
None or several is the user's choice to make, and the error says so in one line. It must not
know how replies are measured.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit, urlunsplit

from replystream.client.formats import server_json
from replystream.client.transport import Headers, TransportError, http_request, with_headers

_ENDPOINTS = ("/chat/completions", "/completions", "/responses", "/messages")


class ModelLookupError(Exception):
    """The models list could not be read, or does not name exactly one model (one line)."""


def models_url(url: str) -> str:
    """The models list beside an OpenAI-compatible endpoint: ``.../v1/chat/completions`` ->
    ``.../v1/models``."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    for endpoint in _ENDPOINTS:
        if path.endswith(endpoint):
            path = path[: -len(endpoint)]
            break
    return urlunsplit(parts._replace(path=f"{path}/models", query="", fragment=""))


# The headers a client sends its key in: OpenAI's and Anthropic's.
KEY_HEADERS = ("authorization", "x-api-key")


async def served_model(
    url: str,
    *,
    timeout_s: float = 30.0,
    headers: Headers | None = None,
    tls: ssl.SSLContext | None = None,
) -> str:
    """The one model the server of endpoint ``url`` lists (``headers``: sent too, such as
    an Authorization the server wants; ``tls``: the context for an https URL).

    Raises:
        ModelLookupError: the list cannot be read, or it names no model or several.
    """
    listing = models_url(url)
    try:
        async with asyncio.timeout(timeout_s):
            sent = with_headers({"Accept": "application/json"}, headers)
            async with http_request(listing, headers=sent, tls=tls) as response:
                body = b"".join([chunk.data async for chunk in response])
                status = response.status
    except TimeoutError:
        reason = f"no answer within {timeout_s:g} s"
        raise ModelLookupError(f"cannot list models at {listing} ({reason})") from None
    except TransportError as exc:
        raise ModelLookupError(f"cannot list models at {listing} ({exc})") from None
    if status in (401, 403):  # naming the model would not help: every request needs the key
        keyed = any(name.lower() in KEY_HEADERS for name, _ in sent)
        advice = (
            "the key sent was refused"
            if keyed
            else "it wants a key: send it with --header 'Authorization: Bearer KEY'"
        )
        raise ModelLookupError(f"{listing} answered HTTP {status}; {advice}")
    if status != 200:
        raise ModelLookupError(f"{listing} answered HTTP {status}; name the model with --model")
    try:
        names = [str(item["id"]) for item in server_json(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise ModelLookupError(
            f"{listing} is not an OpenAI models list; name the model with --model"
        ) from None
    if len(names) == 1:
        return names[0]
    if not names:
        raise ModelLookupError(f"{listing} lists no model; name one with --model")
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    raise ModelLookupError(
        f"{listing} lists {len(names)} models ({shown}); choose one with --model"
    )
