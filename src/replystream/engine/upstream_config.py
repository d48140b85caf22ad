"""The relay's configuration: its upstreams (``UpstreamTarget``), its limits and defaults
(``UpstreamConfig``), and what each upstream is sent as its key and headers
(``UpstreamKeys``).

This file decides what a valid configuration is, so that a mistake stops ``serve`` at
start-up (or a reload of the routes file keeps the routes before) instead of failing every
request later: an upstream's base URL (``base_url_problem``) and its identity however it is
spelt (``upstream_identity``), keys and headers an HTTP request can carry (``key_problem``,
``header_problem``), positive limits, one upstream given once. It must not know how requests
are sent.
"""

from __future__ import annotations

import contextlib
import ipaddress
import ssl
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from replystream.engine.upstream_proxy import Proxy, proxies_of

ROUTINGS = ("least", "prefix")  # how the first upstream for a request is chosen


def base_url_problem(url: str) -> str | None:
    """What makes ``url`` (an http(s) URL) no upstream base URL, in words that follow "an
    upstream URL"; None when nothing does. Checked at start-up, so that a URL no request
    could use stops ``serve`` rather than failing every request later."""
    if not all("!" <= char <= "~" for char in url):
        # A space would split the request line; a control character (which ``urlsplit``
        # drops, some of them) would reach it, the logs and every message naming the
        # upstream; a host that is not ASCII would be sent as no Host header can be.
        return (
            "may hold printable ASCII only, no spaces (percent-encode them, and give a host "
            "in its ASCII form, xn--...)"
        )
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed [ of an IPv6 address
        return "is not a valid URL"
    if parts.username is not None or parts.password is not None:
        # It would be repeated in every error, log line and metric naming the upstream.
        return "may not carry a user name or password (give a key as api_key)"
    if not parts.hostname:
        return "has no host"
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0:
        return "has a port that is not a number from 1 to 65535"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "may not have a query or a fragment"
    return None


DEFAULT_PORTS = {"http": 80, "https": 443}


def upstream_identity(url: str) -> tuple[str, str, int, str]:
    """What tells one upstream from another, however its base URL is spelt: the scheme and
    host in any case (an IPv6 address in any of its spellings: ``[0:0::1]`` is ``[::1]``),
    the port given or its scheme's default, the path without its trailing slashes. ``url``
    is one ``base_url_problem`` found nothing wrong with."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or DEFAULT_PORTS[scheme]
    host = (parts.hostname or "").lower()
    if ":" in host:
        with contextlib.suppress(ValueError):
            host = str(ipaddress.IPv6Address(host))
    return scheme, host, port, parts.path.rstrip("/")


# Headers the relay writes itself on every request to an upstream (the request's framing,
# what it accepts, its key, the ids that follow a request across servers): a routes file's
# ``headers`` may not set them, lest an upstream get two or the relay's be overridden.
OWN_HEADERS = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "accept",
        "accept-encoding",
        "authorization",
        "x-request-id",
        "traceparent",
        "tracestate",
    }
)
# What an HTTP header name (an RFC 9110 token) is made of.
_TOKEN_CHARS = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def header_problem(name: str, value: str) -> str | None:
    """What keeps ``name: value`` out of a request to an upstream, in words that follow the
    header's place in the configuration (None: nothing): a name that is an HTTP token and
    none of the relay's own, a value of printable ASCII (spaces inside it allowed)."""
    if not name or not set(name) <= _TOKEN_CHARS:
        return f"the name {name!r} is no HTTP header name"
    if name.lower() in OWN_HEADERS:
        key = " (give the key as api_key)" if name.lower() == "authorization" else ""
        return f"{name} is a header the relay writes itself{key}"
    if not value or value != value.strip() or not all(" " <= c <= "~" for c in value):
        return (
            f"the value of {name} must be printable ASCII, not empty and with no space at "
            "either end (an HTTP header carries nothing else)"
        )
    return None


def key_problem(key: str) -> str | None:
    """What keeps ``key`` out of an ``Authorization`` header (None: nothing). A key is one
    word: one with a space in it (two keys, a comment after one) would never be taken."""
    if key and all("!" <= char <= "~" for char in key):
        return None
    return "must be one word of printable ASCII (an HTTP header carries nothing else)"


class EntryMistake(ValueError):
    """A routes-file entry at fault, found only when the whole configuration is checked (its
    limits against the server's): its message names the file, the entry and the field, as
    the routes file's own mistakes do."""


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """One upstream: the base URL of its OpenAI API (``http://host:port/v1``), its weight, and
    what a routes file may add: its own API key, or whether it takes the caller's own key
    (``pass_client_key``; None: the server's default), and the models it serves (empty: what
    its ``GET /models`` lists). ``entry``: where a routes file gives it
    (``routes.toml: upstreams[1]``), and ``key_from`` where its own key is configured
    (``routes.toml: upstreams[1].api_key``), for words that send the operator there."""

    base_url: str
    weight: int = 1
    api_key: str | None = field(default=None, repr=False)
    models: tuple[str, ...] = ()
    pass_client_key: bool | None = None
    max_outstanding: int | None = None  # requests at once (None: the server's default)
    # Its own limits to the first content and between pieces (None: the server's).
    ttft_s: float | None = None
    stall_s: float | None = None
    # How an https upstream is reached when not with the system's CAs alone: the CAs its
    # certificate is checked against, and the certificate this relay shows it (mTLS), as a
    # routes file gives them (``upstream_routes``). None: the system's, and none.
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    entry: str | None = None  # None: the command line
    key_from: str | None = None
    # Headers sent with every request and probe to it besides the relay's own (a routes
    # file's ``headers``: an identity-aware proxy's credentials, a tenant's name). Their
    # values may be secrets: never shown, and withheld from an upstream's words as keys are.
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    shows_certificate: bool = False  # its ``tls`` holds a client certificate (``cert_file``)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"an upstream URL must be http:// or https://, got {self.base_url!r}")
        problem = base_url_problem(self.base_url)
        if problem is not None:
            shown = "" if "password" in problem else f", got {self.base_url!r}"
            raise ValueError(f"an upstream URL {problem}{shown}")
        problem = None if self.api_key is None else key_problem(self.api_key)
        if problem is not None:
            raise ValueError(f"the API key of the upstream at {self.base_url} {problem}")
        if self.weight < 1:
            raise ValueError(f"an upstream weight must be at least 1, got {self.weight}")
        if self.max_outstanding is not None and self.max_outstanding < 1:
            raise ValueError(
                f"an upstream's limit of requests at once must be at least 1, got "
                f"{self.max_outstanding}"
            )
        for limit in (self.ttft_s, self.stall_s):
            if limit is not None and not limit > 0:
                raise ValueError(f"the upstream at {self.base_url}: limits must be positive")
        if self.tls is not None and not self.base_url.startswith("https://"):
            raise ValueError(f"the upstream at {self.base_url}: TLS settings need an https:// URL")
        for name, value in self.headers:
            problem = header_problem(name, value)
            if problem is not None:
                raise ValueError(f"the upstream at {self.base_url}: {problem}")
        if self.api_key is not None and self.pass_client_key:
            raise ValueError(
                f"the upstream at {self.base_url} is given a key and told to take the "
                "client's: give one"
            )

    @classmethod
    def parse(cls, spec: str) -> UpstreamTarget:
        """``URL`` or ``URL=WEIGHT``: what follows the last ``=`` is a weight, and must be a whole
        number, unless it holds a ``/`` or follows a query (refused as a URL's)."""
        url, sep, weight = spec.rpartition("=")
        if not sep or not url or "/" in weight or "?" in url or "#" in url:
            return cls(_without_trailing_slash(spec))
        if not (weight.isascii() and weight.isdigit()):
            raise ValueError(f"an upstream weight (after =) must be a whole number, got {weight!r}")
        return cls(_without_trailing_slash(url), int(weight))


def health_path(text: str) -> str:
    """``text`` as the path a health probe asks for after an upstream's base URL (a leading
    ``/`` added). It goes into the probe's request line as it is: visible ASCII only (a space,
    or a CR or LF, would end that line early and start a header of its own), and a path, not a
    URL.

    Raises:
        ValueError: ``text`` is no such path.
    """
    path = text if text.startswith("/") else f"/{text}"
    if not text.strip("/"):
        raise ValueError(
            f"want a path after the upstream's base URL, such as /models, got {text!r}"
        )
    if "://" in text or path.startswith("//"):
        raise ValueError(f"want a path after the upstream's base URL, not a URL: {text!r}")
    if not all("!" <= char <= "~" for char in path) or "#" in path:
        raise ValueError(
            f"a path of visible ASCII characters (no space, no #; escape others as %XX), "
            f"got {text!r}"
        )
    return path


def _without_trailing_slash(url: str) -> str:
    """``url`` without the slashes that end its path (``http://`` stays itself), its scheme in
    lower case (``lower_scheme``)."""
    url = lower_scheme(url)
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rstrip("/")


def lower_scheme(url: str) -> str:
    """``url`` with its scheme in lower case: a scheme is case-insensitive (``HTTP://`` is
    ``http://``), and every check and every name of the upstream reads one spelling."""
    scheme, sep, rest = url.partition("://")
    return scheme.lower() + sep + rest if sep else url


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Where the upstreams are, how long each phase of a relayed reply may take, and when an
    upstream counts as failing."""

    targets: tuple[UpstreamTarget, ...]
    api_key: str | None = field(default=None, repr=False)  # for upstreams without their own
    api_key_from: str = "--upstream-api-key"  # where that key is configured (or its variable)
    # Upstreams without their own key (and not told otherwise) take the caller's own key.
    pass_client_key: bool = False
    model: str | None = None  # None: the first model the upstream's /models lists
    aliases: tuple[tuple[str, str], ...] = ()  # (a name clients use, an upstream's model)
    # (a model, the models its requests go on to, in order, when none of its upstreams can
    # answer them): the routes file's ``fallbacks``.
    fallbacks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    headers_timeout_s: float = 30.0  # connect plus the response head
    # A kept-alive connection idle this long is closed rather than sent a request: a NAT or
    # load balancer on the way may have dropped it without a word (Azure's drops one idle
    # for 4 minutes). A minute, as nginx keeps its upstream connections: short of those, and
    # long enough that a quiet relay seldom pays a new TLS handshake to a hosted API.
    keepalive_s: float = 60.0
    ttft_s: float = 30.0  # an attempt's first text within this, else the next upstream
    stall_s: float = 60.0  # no text for this long mid-reply is a stall
    failover_s: float = 60.0  # other upstreams are tried until this long after the request
    # The most requests each upstream is sent at once (None: no limit; a routes file's
    # ``max_outstanding`` overrides it), and how long a request waits for room at upstreams
    # at their limit before a 503 (0: none).
    max_outstanding: int | None = None
    queue_s: float = 30.0
    # Which upstream a request goes to first: the least loaded ("least"), or the one its
    # prompt's start prefers, within a bound on load ("prefix": ``upstream_affinity``).
    routing: str = "least"
    continuation: bool = False  # a stalled or failed reply goes on at another upstream
    health_s: float = 5.0  # active health probes this often
    health_path: str = "/models"  # what a probe asks each upstream for
    failures: int = 3  # consecutive failures that open an upstream's circuit
    # How long an open circuit keeps its upstream out (also the longest its Retry-After does).
    cooldown_s: float = 10.0
    max_event_size: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("give at least one upstream")
        if not (
            self.headers_timeout_s > 0
            and self.keepalive_s > 0
            and self.stall_s > 0
            and self.max_event_size > 0
        ):
            raise ValueError("upstream timeouts and the event size limit must be positive")
        if self.max_outstanding is not None and self.max_outstanding < 1:
            raise ValueError(
                f"the limit of requests at once must be at least 1, got {self.max_outstanding}"
            )
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.queue_s < 0:
            raise ValueError(f"the wait for room cannot be negative, got {self.queue_s:g}")
        if health_path(self.health_path) != self.health_path:
            raise ValueError(f"the health path must start with /, got {self.health_path!r}")
        seen: dict[tuple[str, str, int, str], str] = {}
        for target in self.targets:
            identity = upstream_identity(target.base_url)
            first = seen.get(identity)
            if first is not None:
                also = "" if first == target.base_url else f" (also as {target.base_url})"
                raise ValueError(f"the upstream at {first} is given twice{also}")
            seen[identity] = target.base_url
            if target.ttft_s is not None and target.ttft_s > self.failover_s:
                past = (
                    f"past the failover window ({self.failover_s:g} s, which ends every wait "
                    "for it): raise --upstream-failover-s too"
                )
                if target.entry is not None:
                    raise EntryMistake(
                        f"{target.entry}.ttft_s: {target.ttft_s:g} s to the first text is {past}"
                    )
                raise ValueError(
                    f"the upstream at {target.base_url} may take {target.ttft_s:g} s to its "
                    f"first text, {past}"
                )
        if self.api_key is not None and self.pass_client_key:
            raise ValueError(
                "a key for every upstream and the client's own key passed on: give one"
            )
        problem = None if self.api_key is None else key_problem(self.api_key)
        if problem is not None:
            raise ValueError(f"the upstream API key {problem}")

    def passes_client_key(self, target: UpstreamTarget) -> bool:
        """Whether ``target`` gets the caller's own key rather than a configured one."""
        if target.pass_client_key is not None:
            return target.pass_client_key
        return self.pass_client_key and target.api_key is None


def upstream_limit(target: UpstreamTarget, config: UpstreamConfig) -> int | None:
    """The most requests ``target`` is sent at once: its own limit, else the default."""
    return config.max_outstanding if target.max_outstanding is None else target.max_outstanding


@dataclass(frozen=True, slots=True)
class UpstreamKeys:
    """What goes to each upstream as its ``Authorization``: its own key, or the caller's own
    (for those in ``passing``), else the key for all; where each is configured; what no
    upstream's words passed on may repeat (``withheld``); and the TLS an https upstream is
    reached with when a routes file gives its own CAs or a client certificate (``tls``);
    the proxy an upstream is reached through (``proxies``, from the environment)."""

    own: dict[str, str | None] = field(repr=False)
    passing: frozenset[str]
    default: str | None = field(repr=False)
    own_from: dict[str, str | None]  # where each upstream's own key is configured
    default_from: str  # where the key for all is
    # Every key and header value configured, longest first.
    configured: tuple[str, ...] = field(repr=False)
    tls: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False)
    extra: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict, repr=False)
    certified: frozenset[str] = frozenset()  # those shown a client certificate
    # The proxy each upstream reached through one is reached through (the environment's).
    proxies: dict[str, Proxy] = field(default_factory=dict)

    @classmethod
    def of(cls, config: UpstreamConfig) -> UpstreamKeys:
        targets = config.targets
        proxies = proxies_of(t.base_url for t in targets)
        keys = {key for key in (config.api_key, *(t.api_key for t in targets)) if key}
        keys.update(value for t in targets for _, value in t.headers)
        return cls(
            {t.base_url: t.api_key for t in targets},
            frozenset(t.base_url for t in targets if config.passes_client_key(t)),
            config.api_key,
            {t.base_url: t.key_from for t in targets},
            config.api_key_from,
            tuple(sorted(keys, key=len, reverse=True)),
            {t.base_url: t.tls for t in targets if t.tls is not None},
            {t.base_url: t.headers for t in targets if t.headers},
            frozenset(t.base_url for t in targets if t.shows_certificate),
            proxies,
        )

    def key_from(self, name: str) -> str | None:
        """Where the key sent to the upstream ``name`` is configured (None: none is; one
        that takes the caller's own key is not asked)."""
        if self.own.get(name):
            return self.own_from.get(name) or "its own api_key"
        return self.default_from if self.default else None

    def withheld(self, name: str, client_key: str | None) -> tuple[str, ...]:
        """The keys no word of the upstream ``name`` passed on may repeat, longest first:
        every key and header value configured, and the caller's own where it is sent to
        ``name``."""
        if not client_key or name not in self.passing:
            return self.configured
        return tuple(sorted({*self.configured, client_key}, key=len, reverse=True))

    def headers(
        self, name: str, client_key: str | None = None, accept: str = "text/event-stream"
    ) -> dict[str, str]:
        """What goes to the upstream ``name`` beside a request whose answer is ``accept``:
        its configured headers and key, or, for one that takes the caller's own,
        ``client_key`` (a health probe has none to send)."""
        headers = {"Accept": accept, "Accept-Encoding": "identity"}
        headers.update(self.extra.get(name, ()))
        key = client_key if name in self.passing else self.own.get(name) or self.default
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers
