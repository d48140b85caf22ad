"""The failures the relay's HTTP client names itself (``upstream_http``,
``upstream_http_connection``); ``upstream_errors`` words them for clients. Besides these, a
request may fail with ``OSError`` or ``ssl.SSLError``.
"""

from __future__ import annotations

import ssl

# What a TLS handshake that got no TLS record back most often means.
TLS_TO_PLAIN = "is it a plain HTTP port? Then its URL begins with http://"


class HttpFailure(Exception):
    """A failure this client names itself."""


class ConnectFailed(HttpFailure):
    """The connection could not be made (refused, unreachable, unresolvable)."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class PeerClosed(HttpFailure):
    """The upstream closed the connection before a complete response head."""


class NotHttp(HttpFailure):
    """What came back is not an HTTP/1.x response head; ``tls``: it begins as a TLS record
    does (a server speaking TLS, sent plain HTTP, answers with an alert); ``h2``: it begins
    as an HTTP/2 frame does (a server speaking HTTP/2 alone)."""

    def __init__(self, message: str, *, tls: bool = False, h2: bool = False) -> None:
        super().__init__(message)
        self.tls = tls
        self.h2 = h2


class HeadTooLarge(HttpFailure):
    """The response head grew past ``MAX_HEAD_BYTES`` (ended or not)."""


class BodyCut(HttpFailure):
    """The connection ended before the body's framing says the body ends."""


class BadFraming(HttpFailure):
    """The body's framing is broken (a bad chunk size line...), or bytes followed its end."""


class Stale(HttpFailure):
    """A reused connection closed before any byte of the answer: send again, once."""


class ProxyFailed(HttpFailure):
    """The proxy an upstream is reached through (``proxy``, as shown) could not be reached
    (``os_error``), its TLS handshake failed (``tls_error``), or it did not open the tunnel
    to it. ``configured``: it refused the tunnel for what the relay is configured with (its
    credentials, or a host it does not allow)."""

    def __init__(
        self,
        message: str,
        *,
        os_error: OSError | None = None,
        tls_error: ssl.SSLError | None = None,
        configured: bool = False,
    ) -> None:
        super().__init__(message)
        self.os_error = os_error
        self.tls_error = tls_error
        self.configured = configured
        self.proxy = ""
