"""Run a real HAProxy, Apache httpd or Varnish for a test, and what tests through them share.

Each runs in the foreground as the test's child, with its config, logs and working files in the
test's tmp dir, so stopping the child stops the proxy. A missing binary skips the test (or
fails it where CI requires every service, as ``tests/services.py`` does for nginx).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from replystream.client import measure_reply
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.engine.simulated import DEFAULT_REPLY, reply_of_length
from replystream.lab.diagnosis import Diagnosis, diagnose
from replystream.lab.local_server import stop_process
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import wait_for
from tests.services import free_port, require_binary, wait_listening

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "docs" / "deploy"

# One 400-token reply at 10 ms a token (about 9 KiB of events): long enough for the verdicts to
# separate clearly, as in tests/test_nginx_doctor.py.
TOKENS = 400

# Where Debian's haproxy.cfg sends its logs (syslog), here only errors, to HAProxy's output.
HAPROXY_GLOBAL = """global
    log stderr format raw local0 err
"""

# Debian's /etc/haproxy/haproxy.cfg `defaults` (its log and errorfile lines left out).
HAPROXY_DEFAULTS = """defaults
    mode http
    timeout connect 5000
    timeout client  50000
    timeout server  50000
"""

APACHE_MODULES = Path("/usr/lib/apache2/modules")  # Debian's
_APACHE_MAIN = """ServerRoot {tmp}
DefaultRuntimeDir {tmp}
PidFile {tmp}/httpd.pid
ErrorLog {tmp}/error.log
LogLevel warn
Listen 127.0.0.1:{port}
ServerName localhost
{modules}
{site}
"""
# What `a2enmod proxy proxy_http` and Debian's defaults load, as far as a proxy uses it.
_APACHE_MODULES = (
    "mpm_event",
    "authz_core",
    "filter",
    "deflate",
    "headers",
    "setenvif",
    "proxy",
    "proxy_http",
)
# What `a2enmod ssl http2` adds (ssl brings socache_shmcb for its session cache).
_APACHE_TLS_MODULES = ("socache_shmcb", "ssl", "http2")


def long_reply_engine(**config: float) -> SimulatedEngine:
    """A 400-token reply at 10 ms a token (``config``: more of ``SimulatedConfig``)."""
    text = reply_of_length(DEFAULT_REPLY, TOKENS)
    settings = {"delay_ms": 10.0, "jitter_ms": 2.0, **config}
    return SimulatedEngine(SimulatedConfig(reply_text=text, **settings))  # type: ignore[arg-type]


def upstream_of(url: str) -> str:
    return urlsplit(url).netloc


async def doctor(url: str) -> Diagnosis:
    """The verdict on one 400-token reply from ``url``'s native stream."""
    return diagnose(await measure_reply(f"{url}/stream?max_tokens={TOKENS}", timeout_s=60))


async def websocket_reply(url: str) -> str:
    """Run one reply over ``url``'s /v1/ws; how it ended (or the refused handshake's status)."""
    async with aiohttp.ClientSession() as http:
        try:
            ws = await http.ws_connect(f"{url}/v1/ws")
        except aiohttp.WSServerHandshakeError as exc:
            return f"refused {exc.status}"
        async with ws:
            await ws.send_json({"type": "reply", "id": "q", "prompt": "Hi", "max_tokens": 5})
            while True:
                message = await ws.receive_json(timeout=60)
                if message["type"] in ("done", "error"):
                    return str(message["type"])


async def leave_during_prefill(url: str, engine: SimulatedEngine, limit_s: float) -> float:
    """Start a stream at ``url``, hang up once its headers came (the engine still silent in
    its prefill), and return how long the engine then took to cancel it (at most ``limit_s``:
    a failed test, not a hung one)."""
    # A reply of an earlier proxy's is cancelled as that proxy stops.
    await wait_for(lambda: engine.stats().active == 0, timeout_s=10)
    split = urlsplit(url)
    reader, writer = await asyncio.open_connection(split.hostname, split.port)
    writer.write(f"GET /stream HTTP/1.1\r\nHost: {split.netloc}\r\n\r\n".encode())
    await writer.drain()
    await reader.readuntil(b"\r\n\r\n")
    # A proxy may send the head before the app has the request.
    await wait_for(lambda: engine.stats().active > 0, timeout_s=10)
    writer.close()
    left = time.monotonic()
    with contextlib.suppress(TimeoutError):
        await wait_for(lambda: engine.stats().active == 0, timeout_s=limit_s)
    return time.monotonic() - left


# A proxy started in front of an app: (the app's URL, the proxy's port, a folder of its own)
# in, the proxy's URL yielded.
ProxyInFront = Callable[[str, int, Path], contextlib.AbstractAsyncContextManager[str]]


async def assert_keepalives_hold_a_silent_prefill(proxy: ProxyInFront, tmp: Path) -> None:
    """A 5 s prefill through ``proxy`` (its idle timeout set below that): with keep-alives
    every 0.5 s the whole reply streams through; without them the proxy gives up on the
    silent app and the stream is cut."""
    engine = long_reply_engine(first_token_ms=5_000.0)
    results = {}
    for keepalive_s in (0.5, None):
        config = ServerConfig(policy=DeliveryPolicy(keepalive_s=keepalive_s))
        async with running(create_app(engine, config)) as app_url:
            port = free_port()
            async with proxy(app_url, port, tmp / str(keepalive_s)) as url:
                results[keepalive_s] = await measure_reply(
                    f"{url}/stream?max_tokens=20", timeout_s=30
                )
    assert results[0.5].complete, results[0.5].error
    assert results[0.5].tokens == 20
    assert not results[None].complete


def substituted(text: str, replacements: Sequence[tuple[str, str]]) -> str:
    """``text`` with each pattern replaced exactly once (a config that drifted fails here)."""
    for pattern, value in replacements:
        text, count = re.subn(pattern, value, text)
        assert count == 1, f"{pattern!r} matched {count} times"
    return text


@contextlib.asynccontextmanager
async def running_haproxy(config: str, port: int, tmp: Path) -> AsyncIterator[str]:
    """HAProxy with ``config`` (which must listen on 127.0.0.1:``port``); yield its URL."""
    binary = require_binary("haproxy")
    conf = _write(tmp, "haproxy.cfg", config)
    async with _running("haproxy", [binary, "-db", "-f", str(conf)], port, tmp / "out.log"):
        yield f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def running_apache(
    site: str, port: int, tmp: Path, tls_port: int | None = None
) -> AsyncIterator[str]:
    """Apache httpd in one process (-X) with Debian's modules for a proxy and ``site`` (a
    VirtualHost or bare directives) listening on 127.0.0.1:``port``; yield its URL.

    With ``tls_port`` it also listens there, with the modules `a2enmod ssl http2` enables and
    Debian's ssl.conf session cache, for a TLS VirtualHost of ``site``.
    """
    binary = require_binary("apache2")
    names = _APACHE_MODULES + (_APACHE_TLS_MODULES if tls_port else ())
    modules = "\n".join(
        f"LoadModule {name}_module {APACHE_MODULES}/mod_{name}.so" for name in names
    )
    if tls_port:
        modules += f"\nListen 127.0.0.1:{tls_port}\nSSLSessionCache shmcb:{tmp}/ssl_scache(512000)"
    main = _APACHE_MAIN.format(tmp=tmp, port=port, modules=modules, site=site)
    conf = _write(tmp, "httpd.conf", main)
    # One process (-X) waits for its threads on SIGTERM, one of them maybe still waiting on
    # the app (ProxyTimeout): kill it soon after.
    command = [binary, "-X", "-f", str(conf)]
    async with _running("apache2", command, port, tmp / "error.log", grace_s=1.0):
        yield f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def running_varnish(
    vcl: str, port: int, tmp: Path, params: Sequence[str] = ()
) -> AsyncIterator[str]:
    """Varnish with ``vcl`` on 127.0.0.1:``port`` (``params``: ``-p NAME=VALUE`` values), its
    working dir in ``tmp``, no jail and no admin port; yield its URL."""
    binary = require_binary("varnishd", debian_package="varnish")
    conf = _write(tmp, "default.vcl", vcl)
    command = [binary, "-F", "-j", "none", "-T", "none", "-s", "malloc,16m"]
    command += ["-a", f"127.0.0.1:{port}", "-f", str(conf), "-n", str(tmp / "work")]
    for param in params:
        command += ["-p", param]
    async with _running("varnishd", command, port, tmp / "out.log"):
        yield f"http://127.0.0.1:{port}"


def _write(tmp: Path, name: str, text: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / name
    path.write_text(text)
    return path


@contextlib.asynccontextmanager
async def _running(
    name: str, command: list[str], port: int, log: Path, grace_s: float = 10.0
) -> AsyncIterator[None]:
    """``command`` as a child (its output to ``log``) until the block ends, then stopped (killed
    after ``grace_s``); entered once it accepts connections on ``port``."""
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(*command, stdout=out, stderr=out)
    try:
        # Varnish compiles its VCL with the C compiler first.
        await wait_listening(name, port, process, log, timeout_s=30)
        yield
    finally:
        await stop_process(process, grace_s)
