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
what a failed write means for a reply (``RedisReplayStore`` retries and repairs). A replica
holds at most ``MAX_CONNECTIONS`` connections per Redis node, and a command past them waits
for one (up to the command timeout) instead of failing: redis-py's default pool raises past
100 connections in use, which a burst of readers reaches at once. One server and Sentinel
use a blocking pool; a Cluster client has one pool per node that cannot block, so its
commands pass a gate of the same size first. This file must not know about replies, HTTP or
event formats.

A one-server URL's query may set what redis-py reads from one and this server leaves to the
operator (``URL_OPTIONS``, and with ``rediss://`` the TLS files and checks); any other name is
refused when the URL is read: redis-py would pass it on to each connection it makes, which
then fails (an unknown name), or would override the timeouts and retries the store is built
around. Sentinel and Cluster URLs take no query.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    NoScriptError,
    RedisClusterException,
    RedisClusterUnreachableError,
    RedisError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from replystream.delivery.replay import FirstContact

Kind = Literal["single", "sentinel", "cluster"]
RedisClient = aioredis.Redis | RedisCluster

# Connections one replica may hold to one Redis node at once. Readers of other replicas'
# replies share one blocking read and writes go in one call per flush, so this is reached
# only by bursts (a few thousand resumes at once), which then queue instead of failing.
MAX_CONNECTIONS = 200
SENTINEL_PORT = 26379
REDIS_PORT = 6379

# What a one-server URL's query may set.
URL_OPTIONS = ("db", "client_name", "health_check_interval", "socket_keepalive", "socket_read_size")
TLS_URL_OPTIONS = (
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "ssl_ciphers",
    "ssl_min_version",
)
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


def _port_of(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:
        raise ValueError("the port is not a whole number from 0 to 65535") from None


def _check_single(url: str, scheme: str, tls: bool) -> None:
    """What redis-py would read from a one-server URL only when it connects, read now."""
    parts = urlsplit(url)
    _port_of(url)
    if scheme == "unix" and not parts.path.strip("/"):
        # redis-py would take it, and fail on every command (connecting to "").
        raise ValueError("a unix:// URL names its socket: unix:///path/to/redis.sock")
    # redis-py takes the path's number as the database, and silently drops any other path.
    if scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdecimal():
        raise ValueError(f"the database must be a number, got {parts.path.strip('/')!r}")
    allowed = URL_OPTIONS + (TLS_URL_OPTIONS if tls else ())
    for name, values in parse_qs(parts.query, keep_blank_values=True).items():
        if name not in allowed:
            raise ValueError(
                f"the query option {name!r} is not one this server takes "
                f"(it takes {', '.join(allowed)}; timeouts and retries are its own)"
            )
        if name == "db" and not values[0].isdecimal():
            raise ValueError(f"the database must be a number, got {values[0]!r}")
    try:
        options = aioredis.connection.parse_url(url)  # the values' types, as redis-py reads them
    except ValueError as exc:
        raise ValueError(str(exc).splitlines()[0]) from None
    _check_values(dict(options))
    if tls:
        _check_tls({name: value for name, value in options.items() if name.startswith("ssl_")})


def _check_values(options: dict[str, Any]) -> None:
    """The values redis-py reads without a word and that fail only on a connection: a
    negative health check interval (every connection's first command then reads another's
    answer), a read size of 0 (every read is taken as Redis closing the connection), a
    client name Redis refuses (as it refuses names with a space, a newline or any character
    outside visible ASCII)."""
    interval = options.get("health_check_interval")
    if interval is not None and interval < 0:
        raise ValueError(f"health_check_interval must be 0 or more seconds, got {interval}")
    size = options.get("socket_read_size")
    if size is not None and size < 1:
        raise ValueError(f"socket_read_size must be 1 or more bytes, got {size}")
    name = options.get("client_name")
    if name and not all("!" <= char <= "~" for char in name):
        raise ValueError(
            f"client_name {name!r}: Redis takes a name of visible ASCII characters, with no space"
        )


def _check_tls(options: dict[str, Any]) -> None:
    """The TLS options read as redis-py reads them only when it connects (its context made,
    its files loaded), read now: a mistake in one would otherwise fail every command, told as
    Redis that cannot be reached (a missing file as "Error 2 connecting to ...")."""
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = options.get(name)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{name}: no file {path}")
    folder = options.get("ssl_ca_path")
    if folder is not None and not os.path.isdir(folder):
        raise ValueError(f"ssl_ca_path: no folder {folder}")
    certfile, keyfile = options.get("ssl_certfile"), options.get("ssl_keyfile")
    if certfile is not None and options.get("ssl_password") is None:
        field = "ssl_certfile" if keyfile is None else "ssl_keyfile"

        def no_passphrase() -> str:
            # Without one OpenSSL asks for it on the terminal, at start and on every connect.
            raise ValueError(f"{field}: the key is encrypted: give its passphrase as ssl_password")

        with contextlib.suppress(ssl.SSLError):  # told below, as redis-py's context says it
            ssl.create_default_context().load_cert_chain(certfile, keyfile, no_passphrase)
    try:
        aioredis.SSLConnection(**options).ssl_context.get()
    except (RedisError, OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        reason = exc.args[0] if len(exc.args) == 1 else exc  # ("No cipher can be selected.",)
        raise ValueError(f"the TLS options cannot be used: {reason}") from None


def parse_redis_url(url: str) -> RedisTarget:
    """The target ``url`` names; ValueError (one line, no credentials) when it names none."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(f"expected one of {', '.join(SCHEMES)}")
    kind, tls = _SCHEMES[scheme]
    if kind == "single":
        _check_single(url, scheme, tls)
        return RedisTarget(url, kind, tls)
    rest, _, query = url.split("://", 1)[1].partition("?")
    if query:
        raise ValueError(f"a {scheme}:// URL takes no query (?{query.split('=', 1)[0]}...)")
    netloc, _, path = rest.partition("/")
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
    if not db.isdecimal():
        raise ValueError(f"the database must be a number, got {db!r}")
    return RedisTarget(url, kind, tls, nodes, segments[0], int(db), username, password)


# How redis-py names a Sentinel it could not ask in ``MasterNotFoundError``: the client's
# whole repr (its pool's and connection's settings, a screenful), where its address is meant.
_SENTINEL_REPR = re.compile(
    r"<redis\.asyncio\.client\.Redis\(<.*?,host=([^,>]+),port=(\d+),.*?\)>\)>\)>(?= - )"
)


# How redis-py begins the error of a pipelined command: the command itself, a script's source
# for EVAL (ours, cut at 50 characters), which is no one's business but ours.
_PIPELINE_COMMAND = re.compile(r"^Command # \d+ \(.*?\) of pipeline caused error: ", re.DOTALL)


# How Redis ends the error of a command a script ran: which of our scripts, at which line.
_SCRIPT_PLACE = re.compile(r"\s*script: [0-9a-f]{40}, on @user_script:\d+\.?$")


def error_text(error: object) -> str:
    """What a Redis error says, as a log line or a client may show it: a Sentinel redis-py
    names by its client's repr is named by its address instead; the command of a pipeline
    that failed (a script's source), and where in a script a command failed, are left
    out."""
    said = _SCRIPT_PLACE.sub("", _PIPELINE_COMMAND.sub("", str(error)))
    return _SENTINEL_REPR.sub(lambda m: f"Sentinel {_host(m[1])}:{m[2]}", said)


class _SentinelBlockingPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (it asks the Sentinels for the primary), waiting for a free connection
    past its size like ``BlockingConnectionPool`` instead of raising.

    A connection to a primary Sentinel no longer names is closed as it comes back, not used
    again: after a planned failover (``SENTINEL FAILOVER``) the old primary goes on taking
    writes until Sentinel makes it a replica, up to about 10 s later, and redis-py's asyncio
    pool would keep handing out the connections made to it beside new ones to the promoted
    replica, so one process would write to two primaries at once (and lose, with the old
    one's data, what went there). redis-py closes only idle connections when it learns of a
    new primary (``get_master_address``), which it asks only as it connects:
    ``follow_primary`` asks every second."""

    async def release(self, connection: Any) -> None:
        primary = self.master_address
        if primary is not None and (connection.host, connection.port) != primary:
            await connection.disconnect()
        await super().release(connection)


class _SentinelClient(aioredis.Redis):
    """A client of Sentinel's primary that, closed, closes its connections to the Sentinels
    too (redis-py leaves those open)."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinels is not None:
            await self.sentinels.aclose()


class _Gate:
    """At most ``size`` commands at once; the next waits up to ``timeout_s`` for a turn."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self._free = asyncio.Semaphore(size)
        self._timeout_s = timeout_s

    async def __aenter__(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._free.acquire()
        except TimeoutError as exc:
            # What the blocking pool raises: the caller treats it like any unreachable Redis.
            raise RedisConnectionError("No connection available.") from exc

    async def __aexit__(self, *exc: object) -> None:
        self._free.release()


async def follow_primary(client: RedisClient) -> None:
    """Through Sentinel: ask which server is the primary now; after a failover, connections
    to the one before are closed (idle ones now, the others as they come back), so every
    command goes to the new one (``_SentinelBlockingPool``). Otherwise nothing.

    Raises:
        RedisError, OSError: the Sentinels could not be asked.
    """
    if isinstance(client, _SentinelClient):
        pool = client.connection_pool
        assert isinstance(pool, _SentinelBlockingPool)
        await pool.get_master_address()  # type: ignore[no-untyped-call, unused-ignore]


@contextlib.contextmanager
def _unreachable_is_a_connection_error() -> Iterator[None]:
    """What a Cluster client raises when it cannot reach Redis, raised as ``ConnectionError``,
    which every caller (the store's retries, its heartbeat, its readers) takes for Redis
    unreachable:

    - redis-py (8.1) lets a connection closed while a command is written to it (a close
      racing a send) escape as ``AttributeError`` or ``TypeError`` from the stream writer
      (redis-py #3546, #4287);
    - no node answering (all down, or a network that drops every packet), or none holding a
      key's slot, is ``RedisClusterUnreachableError`` or ``SlotNotCoveredError``: no
      ``RedisError`` at all, so a heartbeat that met one ended for good, and a write was
      told as a bug, with a traceback, instead of retried until Redis answers again. One
      that no node answered for refusing this server's password is that refusal
      (``AuthenticationError``), as a single Redis says it.
    """
    try:
        yield
    except (AttributeError, TypeError) as exc:
        raise RedisConnectionError(f"connection closed while in use ({exc})") from exc
    except (RedisClusterUnreachableError, SlotNotCoveredError) as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, AuthenticationError):
            raise cause from exc
        raise RedisConnectionError(str(exc)) from exc


class _GatedPipeline(ClusterPipeline):
    def __init__(self, client: GatedCluster, transaction: Any = None) -> None:
        super().__init__(client, transaction)
        self._gate = client.gate

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        async with self._gate:
            with _unreachable_is_a_connection_error():
                return await super().execute(raise_on_error, allow_redirections)


def _first_stream(args: tuple[EncodableT, ...]) -> str | None:
    """The first stream an ``XREAD`` names (None for any other command)."""
    if not args or str(args[0]).upper() != "XREAD":
        return None
    for n, word in enumerate(args[1:-1], start=1):
        if word in (b"STREAMS", "STREAMS"):
            key = args[n + 1]
            return key.decode() if isinstance(key, bytes) else str(key)
    return None


class GatedCluster(RedisCluster):
    """A Cluster client whose commands (and pipelines, one connection per node each) pass a
    gate no larger than each node's pool: at most ``max_connections`` in use on any node,
    and the next one waits rather than raising ``MaxConnectionsError``."""

    def __init__(self, *, pool_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = _Gate(kwargs.get("max_connections", MAX_CONNECTIONS), pool_timeout_s)

    async def execute_command(self, *args: EncodableT, **kwargs: Any) -> Any:
        async with self.gate:
            with _unreachable_is_a_connection_error():
                if "target_nodes" not in kwargs:
                    stream = _first_stream(args)
                    if stream is not None:
                        # redis-py asks its default node (the first shard's primary, kept
                        # however it fails: its own retries are off) which keys an XREAD
                        # names, before each one: with that node dark, or down, every
                        # blocking read failed, those of the shards that answer too. Its
                        # streams share a slot (the caller's rule): sent to that slot's node.
                        kwargs["target_nodes"] = self.get_node_from_key(stream)
                return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused, as redis-py does
        # redis-py declares the dispatcher abstract on a base; ClusterPipeline sets it.
        return _GatedPipeline(self, transaction)  # type: ignore[abstract]


def connect(
    target: RedisTarget,
    *,
    connect_timeout_s: float,
    command_timeout_s: float,
    max_connections: int = MAX_CONNECTIONS,
) -> RedisClient:
    """A client for ``target`` (it connects on first use). A command waits up to
    ``command_timeout_s`` for one of ``max_connections`` (per node) to be free."""
    no_retry = Retry(NoBackoff(), 0)
    timeouts = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": command_timeout_s}
    if target.kind == "single":
        pool = aioredis.BlockingConnectionPool.from_url(
            target.url,
            max_connections=max_connections,
            timeout=command_timeout_s,
            retry=no_retry,
            **timeouts,
        )
        return aioredis.Redis.from_pool(pool)
    if target.kind == "cluster":
        return GatedCluster(
            pool_timeout_s=command_timeout_s,
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            username=target.username,
            password=target.password,
            ssl=target.tls,
            retry=no_retry,
            max_connections=max_connections,
            **timeouts,
        )
    # redis-py 8 types Sentinel's constructor; earlier releases do not (hence both codes).
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(target.nodes),
        sentinel_kwargs=dict(timeouts),
        retry=no_retry,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=command_timeout_s,
    )
    client: _SentinelClient = sentinel.master_for(
        target.service,
        redis_class=_SentinelClient,
        connection_pool_class=_SentinelBlockingPool,
        max_connections=max_connections,
        timeout=command_timeout_s,
        db=target.db,
        username=target.username,
        password=target.password,
        ssl=target.tls,
    )
    client.sentinels = sentinel
    return client


# The script first contact runs: it touches nothing (a key is named only for the ACL check).
_PROBE = "return 0"


async def first_contact(
    target: RedisTarget, key: str, *, connect_timeout_s: float, command_timeout_s: float
) -> FirstContact | None:
    """Ask Redis once, on a client of its own, whether it takes the commands the store sends:
    a connection (its password, or none, its database, its TLS certificate) and a script
    call on ``key`` (a user allowed ``SCRIPT LOAD``, ``EVALSHA``, ``EVAL`` and that key), and
    ``INFO``. None when it takes them.

    Failing every command, a wrong password, ``NOAUTH``, a database out of range or an ACL
    user without a command or key the store uses would be retried as a failover and found by
    each request in turn; a Redis that cannot be reached now (not yet started, or failing
    over) may be reached later, and is not refused.
    """
    client = connect(
        target,
        connect_timeout_s=connect_timeout_s,
        command_timeout_s=command_timeout_s,
        max_connections=1,
    )
    try:
        await client.ping()
        # The store's scripts go by their digest (EVALSHA), loaded first where Redis lacks
        # them (SCRIPT LOAD: at first use, and after a restart), and a repair sends its
        # script whole (EVAL): a Redis that renames or disables one of them, or an ACL user
        # without it, would refuse every write.
        digest = await client.script_load(_PROBE)
        with contextlib.suppress(NoScriptError):  # a Cluster node that lacks it: allowed
            await client.evalsha(digest, 1, key)  # type: ignore[no-untyped-call, unused-ignore]
        await client.eval(_PROBE, 1, key)  # type: ignore[no-untyped-call, unused-ignore]
        # Which server answers (its run_id) tells a restart that lost every reply from one no
        # command saw (``RedisLink.servers_changed``); refused (an ACL user without the
        # @dangerous commands), such a restart would go unnoticed, each beat's ask failing
        # without a word.
        await client.info("server")
    except AuthenticationError as exc:  # a ConnectionError, but a waiting one never passes
        return FirstContact(True, error_text(exc))
    except RedisConnectionError as exc:
        # A Redis certificate this server does not trust is a setting to change, not an outage.
        refused = isinstance(exc.__cause__, ssl.SSLCertVerificationError)
        return FirstContact(refused, error_text(exc))
    except RedisClusterException as exc:
        # Any other failure of the Cluster client's own (no node answering, or refusing this
        # server's password, comes as the two above): refused when it names that refusal.
        refused = isinstance(exc.__cause__ or exc.__context__, AuthenticationError)
        return FirstContact(refused, error_text(exc))
    except (RedisTimeoutError, OSError) as exc:
        return FirstContact(False, error_text(exc))
    except RedisError as exc:  # NOPERM, a database out of range, ...
        return FirstContact(True, error_text(exc))
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
    return None
