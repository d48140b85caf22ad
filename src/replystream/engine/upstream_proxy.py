"""Which proxy the relay reaches an upstream through, and the tunnel it opens through one.

This file decides, from the environment as curl, requests and httpx read it (``HTTPS_PROXY``
for an https upstream, ``HTTP_PROXY`` for an http one, ``NO_PROXY`` for the hosts reached
directly, networks among them; either case; parsed by the standard library's
``urllib.request``), whether an upstream is reached through a proxy, and how a connection to
it is made: to an https upstream, a tunnel the proxy opens on ``CONNECT`` (``open_tunnel``),
in which TLS is spoken with the upstream end to end; to an http one, a connection to the
proxy, sent requests in absolute form (``upstream_http`` writes them). A proxy is spoken to
in plain HTTP (``http://``, as most are) or in TLS (``https://``: its certificate checked
against the system's CAs, which ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` name as OpenSSL reads
them; a tunnel to an https upstream is then TLS inside TLS). A user name and password in a
proxy's URL go to it as ``Proxy-Authorization`` and never into a message. It must not know
what goes through it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import ipaddress
import ssl
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar
from urllib.parse import unquote, urlsplit

from replystream.engine.upstream_http_failures import TLS_TO_PLAIN, ProxyFailed

MAX_ANSWER_BYTES = 16 * 1024  # a proxy's answer to CONNECT: its status line and headers
# A TLS handshake with a proxy takes a few round trips; one still unfinished after this long
# is most often a proxy that speaks plain HTTP waiting for a request line (an https:// URL
# given for it), which would otherwise be waited for until the attempt's head timeout and
# then said as the upstream's silence.
PROXY_TLS_HANDSHAKE_S = 10.0


def proxy_handshake_s(within_s: float) -> float:
    """How long a TLS handshake with a proxy may take for a request (or probe) that must be
    answered ``within_s``: ``PROXY_TLS_HANDSHAKE_S``, or half of that time when it is
    shorter, so that a proxy that never finishes is named as the proxy, not left to the
    caller's deadline (said as the upstream's silence) with the tunnel and the upstream's
    answer still to come in the other half."""
    return min(PROXY_TLS_HANDSHAKE_S, within_s / 2)


@dataclass(frozen=True, slots=True)
class Proxy:
    """A proxy an upstream is reached through."""

    host: str
    port: int
    shown: str  # its URL without user name or password, and the variable it came from
    # The user name and password its URL holds (None: none).
    credentials: tuple[str, str] | None = field(default=None, repr=False)
    tls: bool = False  # spoken to in TLS (an https:// URL)

    @property
    def authorization(self) -> str | None:
        """``Proxy-Authorization``'s value (None: none is sent)."""
        if self.credentials is None:
            return None
        pair = ":".join(self.credentials).encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")

    @property
    def url(self) -> str:
        """Its URL without user name or password."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"


def proxies_of(base_urls: Iterable[str]) -> dict[str, Proxy]:
    """The proxy each upstream (by base URL) is reached through, from the environment
    (those reached directly are left out). Raises ValueError for a proxy URL this relay
    cannot use, naming its variable."""
    found = urllib.request.getproxies_environment()
    chosen = {}
    for url in base_urls:
        parts = urlsplit(url)
        proxy_url = found.get(parts.scheme)
        if not proxy_url or _bypassed(parts.netloc, parts.hostname or "", found.get("no", "")):
            continue
        chosen[url] = _proxy(proxy_url, f"{parts.scheme.upper()}_PROXY")
    return chosen


def _bypassed(netloc: str, host: str, no_proxy: str) -> bool:
    """Whether ``NO_PROXY`` names the host: as ``urllib.request`` reads it (names, domain
    suffixes, ``*``), or, for an address, the address itself (an IPv6 one with or without
    brackets: ``::1``, which ``urllib.request`` matches against ``[::1]`` and so misses) or a
    network it is in (``10.0.0.0/8``, as curl and requests read it: what a cluster's own
    addresses are given as)."""
    if urllib.request.proxy_bypass(netloc):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    for entry in no_proxy.split(","):
        entry = entry.strip()
        with contextlib.suppress(ValueError):
            if "/" in entry:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            elif ipaddress.ip_address(entry.removeprefix("[").removesuffix("]")) == address:
                return True
    return False


def _proxy(url: str, variable: str) -> Proxy:
    if "://" not in url:
        url = f"http://{url}"  # host:port, as curl takes it
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{variable}: the proxy's URL is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{variable}: a proxy reached over {parts.scheme or 'no scheme'} is not supported: "
            "give its http:// or https:// URL"
        )
    credentials = None
    if parts.username is not None:
        credentials = (unquote(parts.username), unquote(parts.password or ""))
    proxy = Proxy(parts.hostname, port, "", credentials, tls=parts.scheme == "https")
    return replace(proxy, shown=f"{proxy.url} ({variable})")


class _Answer(asyncio.Protocol):
    """Reads the head of a proxy's answer to ``CONNECT``, and whether more came with it (a
    refusal's page; from a tunnel opened, nothing may come before the upstream is spoken to)."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[tuple[bytes, bool]] = loop.create_future()
        self.read = b""

    def data_received(self, data: bytes) -> None:
        if self.head.done():
            return
        self.read += data
        end = self.read.find(b"\r\n\r\n")
        if end >= 0:
            self.head.set_result((self.read[:end], end + 4 < len(self.read)))
        elif len(self.read) > MAX_ANSWER_BYTES:
            self.head.set_exception(ProxyFailed("its answer to CONNECT is too large"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_exception(ProxyFailed("it closed the connection before answering"))


async def open_tunnel(
    proxy: Proxy, host: str, port: int, *, handshake_s: float
) -> asyncio.Transport:
    """A connection through ``proxy`` to ``host``:``port``, once the proxy said it is open
    (``ProxyFailed`` when it cannot be reached or refuses; a TLS handshake with it bounded
    by ``handshake_s``). The caller speaks TLS in it."""
    try:
        return await _tunnel(proxy, host, port, handshake_s)
    except ProxyFailed as failure:
        failure.proxy = proxy.shown
        raise


async def connect_to(proxy: Proxy, protocol: asyncio.Protocol, *, handshake_s: float) -> None:
    """Connect ``protocol`` to ``proxy`` itself (to send it requests in absolute form)."""
    try:
        await _reach(proxy, lambda: protocol, handshake_s)
    except ProxyFailed as failure:
        failure.proxy = proxy.shown
        raise


@functools.cache
def _proxy_tls() -> ssl.SSLContext:
    # The system's CAs (or SSL_CERT_FILE's): loading them takes milliseconds, so once.
    return ssl.create_default_context()


P = TypeVar("P", bound=asyncio.Protocol)


async def _reach(
    proxy: Proxy, factory: Callable[[], P], handshake_s: float
) -> tuple[asyncio.Transport, P]:
    """A connection to ``proxy``, in TLS if it is spoken to so (its handshake bounded by
    ``handshake_s``)."""
    loop = asyncio.get_running_loop()
    tls = _proxy_tls() if proxy.tls else None
    try:
        if tls is None:
            transport, protocol = await loop.create_connection(factory, proxy.host, proxy.port)
        else:
            transport, protocol = await loop.create_connection(
                factory,
                proxy.host,
                proxy.port,
                ssl=tls,
                server_hostname=proxy.host,
                ssl_handshake_timeout=handshake_s,
            )
    except ssl.SSLError as exc:  # (an OSError too): worded by ``upstream_errors``
        raise ProxyFailed("its TLS handshake failed", tls_error=exc) from None
    except ConnectionAbortedError as exc:
        if tls is None:
            raise ProxyFailed("it cannot be reached", os_error=exc) from None
        # asyncio's and uvloop's words for a handshake past its time.
        raise ProxyFailed(
            f"it did not finish a TLS handshake within {handshake_s:g} s: {TLS_TO_PLAIN}"
        ) from None
    except OSError as exc:
        raise ProxyFailed("it cannot be reached", os_error=exc) from None
    return transport, protocol


async def _tunnel(proxy: Proxy, host: str, port: int, handshake_s: float) -> asyncio.Transport:
    transport, answer = await _reach(proxy, _Answer, handshake_s)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if proxy.authorization:
        request += f"Proxy-Authorization: {proxy.authorization}\r\n"
    transport.write(f"{request}\r\n".encode("latin-1"))
    try:
        head, more = await answer.head
        status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        version, _, rest = status_line.partition(" ")
        status, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not status.isdigit():
            raise ProxyFailed("its answer to CONNECT is not HTTP")
        if not 200 <= int(status) < 300:
            raise tunnel_refused(int(status), reason)
        if more:
            raise ProxyFailed("it sent bytes after its answer to CONNECT")
    except BaseException:
        transport.close()
        raise
    return transport


# What a proxy's 407 asks for, in words that follow its status.
CREDENTIALS_ASKED = (
    "it asks for a user name and password (they go in the proxy's URL: "
    "http://user:password@host:port)"
)


def tunnel_refused(status: int, reason: str) -> ProxyFailed:
    """A proxy's answer to ``CONNECT`` other than 2xx, in our words."""
    said = f"it refused the tunnel: {status} {reason}".rstrip()
    if status == 407:
        said += f"; {CREDENTIALS_ASKED}"
    elif status == 403:
        said += " (does it allow a tunnel to that host and port?)"
    return ProxyFailed(said, configured=status in (403, 407))
