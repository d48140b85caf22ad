"""What went wrong with an upstream, in our words: a client (and an operator reading
``/healthz``) learns what failed and where, never an exception class or a library's repr.

This file decides the message and code of each transport failure: before the response head
(``connect_failure``: refused, unresolvable, TLS, disconnected, not HTTP), and after it
(``broken_stream``: cut mid-body, broken framing, broken otherwise), from the relay's own
client (``upstream_http``'s failures, ``OSError``, ``ssl.SSLError``), which relayed requests
and health probes both use. What the failure means for the reply (its status, whether it
ends) is the callers'. The library's own text goes to the log at debug level only. It must
not know how a request is built or which upstream was picked.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from replystream.engine.upstream_http_connection import MAX_HEAD_BYTES
from replystream.engine.upstream_http_failures import (
    TLS_TO_PLAIN,
    BadFraming,
    BodyCut,
    ConnectFailed,
    HeadTooLarge,
    NotHttp,
    PeerClosed,
    ProxyFailed,
)

log = logging.getLogger("replystream.upstream")


@dataclass(frozen=True, slots=True)
class Failure:
    """A transport failure in words: what happened, and a short machine-readable code.
    ``lasting``: the relay's configuration of the upstream is the cause (its URL's scheme,
    the CA it trusts, a proxy's credentials), which no retry changes."""

    message: str
    code: str
    lasting: bool = False


# What to do about the two ways a URL's scheme can disagree with its port.
PLAIN_TO_TLS = "it is a TLS port, spoken to in plain HTTP: its URL must begin with https://"
# A proxy spoken to in TLS is checked against the system's CAs (OpenSSL reads this variable).
PROXY_CA_HINT = "; a private CA's certificate goes in SSL_CERT_FILE"


# The relay's own shortage, not the upstream's: no file descriptor (``ulimit -n``, the
# system's table) or memory left for a socket.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Its code: counted on no upstream's circuit (``upstream_relay_types.NOT_ITS_HEALTH``).
OWN_SHORTAGE = "server_out_of_resources"


def own_shortage(exc: BaseException) -> OSError | None:
    """The error of ``exc`` that says this process ran out of file descriptors or memory for
    a connection (None: it says no such thing). That is no failure of the upstream."""
    error = exc.os_error if isinstance(exc, ConnectFailed | ProxyFailed) else exc
    if isinstance(error, OSError) and error.errno in OUT_OF_RESOURCES:
        return error
    return None


def _os_reason(error: OSError | None) -> str:
    """``connection refused``, ``network is unreachable``: the system's words for an errno."""
    if error is not None and error.errno:
        return os.strerror(error.errno).lower()
    return "the connection failed"


# OpenSSL's reasons when what came back is no TLS record.
_NOT_TLS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE")


def _tls_configured(exc: BaseException | None) -> bool:
    """Whether a failed TLS handshake says what the relay is configured with: a certificate
    its CAs do not trust, or a plain HTTP server at an https:// URL."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    return isinstance(exc, ssl.SSLError) and exc.reason in _NOT_TLS


def _tls_reason(exc: BaseException, *, ca_hint: str = "") -> str:
    """A failed TLS handshake in our words; ``ca_hint``: where an untrusted certificate's CA
    would go, said with it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        verify = exc.verify_message or "verification failed"
        return f"its TLS certificate is not trusted ({verify}{ca_hint})"
    reason = exc.reason if isinstance(exc, ssl.SSLError) else None
    if reason in _NOT_TLS:
        # What came back is no TLS record: most often a plain HTTP server's answer.
        return f"it did not answer in TLS ({reason.lower().replace('_', ' ')}): {TLS_TO_PLAIN}"
    if reason:
        return f"the TLS handshake failed ({reason.lower().replace('_', ' ')})"
    return "the TLS handshake failed"


def connect_failure(
    exc: BaseException,
    base_url: str,
    *,
    shows_certificate: bool,
) -> Failure:
    """A failure to send a request (or a health probe) to ``base_url`` or to read its
    response head (``upstream_http``'s failures, ``OSError``, ``ssl.SSLError``).
    ``shows_certificate``: the relay shows this upstream a client certificate."""
    log.debug("upstream %s: %r", base_url, exc)
    where = f"the upstream at {base_url}"
    shortage = own_shortage(exc)
    if shortage is not None:
        return Failure(
            f"this server cannot open a connection to {where} now: {_os_reason(shortage)}",
            OWN_SHORTAGE,
        )
    if isinstance(exc, ProxyFailed):
        reason = str(exc)
        if exc.tls_error is not None:
            reason = _tls_reason(exc.tls_error, ca_hint=PROXY_CA_HINT)
        said = f"cannot connect to {where} through the proxy at {exc.proxy}: {reason}"
        if isinstance(exc.os_error, socket.gaierror):
            said += " (its host name does not resolve)"
        elif exc.os_error is not None:
            said += f" ({_os_reason(exc.os_error)})"
        lasting = exc.configured or _tls_configured(exc.tls_error)
        return Failure(said, "upstream_unavailable", lasting)
    if isinstance(exc, ssl.SSLError):
        said = f"cannot connect to {where}: {_tls_reason(exc)}"
        return Failure(said, "upstream_tls", _tls_configured(exc))
    if isinstance(exc, ConnectFailed) and isinstance(exc.os_error, socket.gaierror):
        return Failure(
            f"cannot connect to {where}: its host name does not resolve", "upstream_unavailable"
        )
    if isinstance(exc, ConnectFailed):
        return Failure(
            f"cannot connect to {where}: {_os_reason(exc.os_error)}", "upstream_unavailable"
        )
    if isinstance(exc, PeerClosed | ConnectionResetError):
        said = f"{where} closed the connection before answering"
        if base_url.startswith("https://") and not shows_certificate:
            # A TLS server that wants a client certificate and sends no alert (Python's
            # asyncio servers: uvicorn's, vLLM's with --ssl-cert-reqs) closes so, once the
            # TLS 1.3 handshake is done.
            said += (
                "; does it ask for a client certificate? This relay shows none (cert_file and "
                "key_file in the routes file)"
            )
        return Failure(said, "upstream_disconnected")
    if isinstance(exc, BodyCut):  # a probe's answer, read whole
        return Failure(f"{where} closed the connection mid-answer", "upstream_disconnected")
    if isinstance(exc, HeadTooLarge):
        return Failure(
            f"{where} sent a response head larger than {MAX_HEAD_BYTES // 1024} KiB",
            "upstream_bad_response",
        )
    if isinstance(exc, NotHttp) and exc.tls:
        return Failure(f"{where} answered in TLS: {PLAIN_TO_TLS}", "upstream_tls", True)
    if isinstance(exc, NotHttp) and exc.h2:
        return Failure(
            f"{where} answered in HTTP/2 alone; this relay speaks HTTP/1.1 to upstreams",
            "upstream_bad_response",
            True,
        )
    if isinstance(exc, NotHttp | BadFraming):
        return Failure(f"{where} sent a response that is not valid HTTP", "upstream_bad_response")
    if isinstance(exc, OSError):
        return Failure(f"the connection to {where} failed: {_os_reason(exc)}", "upstream_broken")
    return Failure(f"the request to {where} failed", "upstream_unavailable")


def broken_stream(exc: BaseException, base_url: str, *, replied: bool = True) -> Failure:
    """A failure reading the body of a reply from ``base_url`` whose response head came.
    ``replied``: some of the reply (text, a call, thinking) had come before it; else only the
    head and perhaps keep-alive comments had, and the words say so (what failed is the same:
    the relay may still try another upstream)."""
    log.debug("upstream %s: its stream broke: %r", base_url, exc)
    where = f"the upstream at {base_url}"
    when = "mid-reply" if replied else "before sending any of the reply"
    if isinstance(exc, BadFraming):
        return Failure(f"{where} sent a body whose HTTP framing is broken", "upstream_broken")
    if isinstance(exc, ConnectionResetError | BodyCut | PeerClosed):
        # A killed or restarted model server: the body ends before its framing says it may.
        return Failure(f"{where} closed the connection {when}", "upstream_disconnected")
    return Failure(f"the connection to {where} broke {when}", "upstream_broken")


# What stands for a key of ours an upstream's message repeats (some quote the key they
# refused): its words go on to a client, to /healthz and to the log.
KEY_WITHHELD = "(key withheld)"


# How Python prints a traceback, which some servers put in an error's message (a 500 from
# a FastAPI app that returns ``traceback.format_exc()``): its file paths and lines of code are
# the upstream's insides, for its own log, not our clients.
TRACEBACK = "Traceback (most recent call last):"


def without_traceback(text: str) -> str:
    """``text`` with a Python traceback in it cut to its last line, the exception and its
    words (what failed), or, where that line cannot be told from the frames (the traceback
    flattened onto one line, or cut short), left out whole."""
    at = text.find(TRACEBACK)
    if at < 0:
        return text
    lines = [line.strip() for line in text[at + len(TRACEBACK) :].splitlines() if line.strip()]
    last = lines[-1] if len(lines) > 1 and not lines[-1].startswith("File ") else ""
    kept = " ".join(part for part in (text[:at].strip(), last) if part)
    return f"{kept} (its traceback not passed on)" if kept else "a traceback, not passed on"


def quoted(text: str, limit: int = 300, withheld: Sequence[str] = ()) -> str:
    """An upstream's own message, fit for one line of ours: a Python traceback in it cut to
    its exception (``without_traceback``); each key of ``withheld`` (the longest first) out,
    before the length is bounded so that no part of one is left either; controls out."""
    text = without_traceback(text)
    for key in withheld:
        text = text.replace(key, KEY_WITHHELD)
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
