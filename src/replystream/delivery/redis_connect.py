"""Which Redis a ``--redis-url`` names, and a client for it: one server, Sentinel, or Cluster.

redis-py parses ``redis://``, ``rediss://`` and ``unix://`` URLs itself and knows Sentinel and
Cluster, but has no URL for either. The forms here are the ones other tools use:

- ``redis+sentinel://[user:pass@]host[:port][,host[:port]...]/service_name[/db]``: the
  Sentinels to ask (port 26379 unless given) and the service they watch; the client follows
  the primary through a failover. ``rediss+sentinel://`` speaks TLS to the data nodes.
  A password in the URL is the data nodes'; Sentinels are asked without one.
- ``redis+cluster://[user:pass@]host[:port][,host[:port]...]``: any nodes of a Redis
  Cluster to start from (port 6379 unless given); ``rediss+cluster://`` with TLS.

redis-py's own retries are turned off: a command that fails reaches the store, which knows
what a failed write means for a reply (``RedisReplayStore`` retries and repairs). This file
must not know about replies, HTTP or event formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

Kind = Literal["single", "sentinel", "cluster"]
RedisClient = aioredis.Redis | RedisCluster

SENTINEL_PORT = 26379
REDIS_PORT = 6379
_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}
SCHEMES = tuple(f"{scheme}://" for scheme in _SCHEMES)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed ``--redis-url``."""

    url: str
    kind: Kind
    tls: bool
    nodes: tuple[tuple[str, int], ...] = ()  # Sentinels, or Cluster nodes to start from
    service: str = ""  # the Sentinel service name
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def shown(self) -> str:
        """The URL as errors may show it: without a user name or password."""
        if self.kind == "single":
            return _shown_single(self.url)
        scheme = urlsplit(self.url).scheme
        hosts = ",".join(f"{_host(h)}:{p}" for h, p in self.nodes)
        path = f"/{self.service}/{self.db}" if self.kind == "sentinel" else ""
        return f"{scheme}://{hosts}{path}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _shown_single(url: str) -> str:
    parts = urlsplit(url)
    if parts.hostname is None:
        return f"{parts.scheme}://{parts.path}"  # a unix socket
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{_host(parts.hostname)}{port}{parts.path}"


def _nodes(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hosts = netloc.rsplit("@", 1)[-1]
    nodes = []
    for member in hosts.split(","):
        # A bracketed IPv6 host, or host[:port]: urlsplit cannot take a list of them.
        parts = urlsplit(f"//{member}")
        if not parts.hostname:
            raise ValueError(f"no host in {member!r}")
        nodes.append((parts.hostname, parts.port or default_port))
    return tuple(nodes)


def parse_redis_url(url: str) -> RedisTarget:
    """The target ``url`` names; ValueError (one line, no credentials) when it names none."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(f"expected one of {', '.join(SCHEMES)}")
    kind, tls = _SCHEMES[scheme]
    if kind == "single":
        return RedisTarget(url, kind, tls)
    rest = url.split("://", 1)[1]
    netloc, _, path = rest.partition("/")
    path = path.split("?", 1)[0]
    username = password = None
    if "@" in netloc:
        userinfo = netloc.rsplit("@", 1)[0]
        user, _, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    default_port = SENTINEL_PORT if kind == "sentinel" else REDIS_PORT
    nodes = _nodes(netloc, default_port)
    segments = [s for s in path.split("/") if s]
    if kind == "cluster":
        if segments:
            raise ValueError("a Redis Cluster has only database 0: no path after the nodes")
        return RedisTarget(url, kind, tls, nodes, username=username, password=password)
    if not segments or len(segments) > 2:
        raise ValueError("a Sentinel URL names its service: .../service_name[/db]")
    db = segments[1] if len(segments) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"the database must be a number, got {db!r}")
    return RedisTarget(url, kind, tls, nodes, segments[0], int(db), username, password)


def connect(
    target: RedisTarget, *, connect_timeout_s: float, command_timeout_s: float
) -> RedisClient:
    """A client for ``target`` (it connects on first use)."""
    no_retry = Retry(NoBackoff(), 0)
    if target.kind == "single":
        return aioredis.Redis.from_url(
            target.url,
            retry=no_retry,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=command_timeout_s,
        )
    if target.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            username=target.username,
            password=target.password,
            ssl=target.tls,
            retry=no_retry,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=command_timeout_s,
        )
    timeouts = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": command_timeout_s}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(target.nodes), sentinel_kwargs=dict(timeouts), retry=no_retry, **timeouts
    )
    client: aioredis.Redis = sentinel.master_for(
        target.service,
        db=target.db,
        username=target.username,
        password=target.password,
        ssl=target.tls,
    )
    return client
