"""Which error type each API gives a failure, by the HTTP status it is before a stream.

One home for the rule, read twice: by the error responses before a stream's first byte
(``server.errors``), and by the in-band errors after it (the dialects' ``error`` events), so
one failure has one type however it is read: streamed, or asked whole. It knows no HTTP
server; a status here is only the number a failure is known by.
"""

from __future__ import annotations

# Anthropic's error types, by status.
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    410: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Anthropic's API has no 503: a service that cannot take a request now is its 529, which its
# SDKs raise as ``OverloadedError`` (and retry, as every 5xx).
ANTHROPIC_OVERLOADED = 529


def openai_error_type(status: int) -> str:
    """The ``type`` OpenAI gives an error of ``status``: every refusal an
    ``invalid_request_error`` (a wrong key and an unknown model too: the ``code`` tells them
    apart), a rate limit on requests ``requests``, a failure on the server's side
    ``server_error``."""
    if status >= 500:
        return "server_error"
    return "requests" if status == 429 else "invalid_request_error"


def anthropic_status(status: int) -> int:
    """The status Anthropic's API answers for ours: a 503 is its 529."""
    return ANTHROPIC_OVERLOADED if status == 503 else status


def anthropic_error_type(status: int) -> str:
    """The ``error.type`` Anthropic's clients read for an HTTP ``status`` (ours: a 503 is
    its ``overloaded_error``): a failure of ours or of an upstream is its ``api_error``, a
    gateway's time-out its ``timeout_error``, a body too large its ``request_too_large``."""
    kind = _ANTHROPIC_TYPE_BY_STATUS.get(anthropic_status(status))
    if kind is not None:
        return kind
    return "api_error" if status >= 500 else "invalid_request_error"
