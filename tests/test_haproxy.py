"""HAProxy in front of the real server: the doctor names its defaults, docs/deploy/haproxy.cfg
streams, passes the WebSocket transport on, cancels a reply whose client left, and the
keep-alives hold a silent stream open past its idle timeouts."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp

from replystream.server import create_app, running
from tests.nginx import SiteTls
from tests.processes import replica
from tests.proxies import (
    DEPLOY,
    HAPROXY_DEFAULTS,
    HAPROXY_GLOBAL,
    assert_keepalives_hold_a_silent_prefill,
    doctor,
    leave_during_prefill,
    long_reply_engine,
    running_haproxy,
    substituted,
    upstream_of,
    websocket_reply,
)
from tests.services import free_port


def frontend(port: int, upstream: str, options: str = "") -> str:
    """Debian's defaults and a plain frontend on ``port`` proxying to ``upstream``."""
    return (
        f"{HAPROXY_DEFAULTS}frontend fe\n    bind 127.0.0.1:{port}\n{options}"
        f"    default_backend app\nbackend app\n    server app {upstream}\n"
    )


def deploy_config(app_url: str, port: int, tls: SiteTls | None = None) -> str:
    """docs/deploy/haproxy.cfg, its port and upstream substituted, after a global section.

    With ``tls`` its TLS listener (HTTP/2) is on ``tls.port`` with that certificate (HAProxy
    takes it and its key in one file, written beside them); without, the listener is left
    out, as a site without a certificate would.
    """
    text = HAPROXY_GLOBAL + (DEPLOY / "haproxy.cfg").read_text()
    tls_bind = ""
    if tls is not None:
        pem = tls.certificate.with_suffix(".with-key.pem")
        pem.write_text(tls.certificate.read_text() + tls.key.read_text())
        tls_bind = f"bind 127.0.0.1:{tls.port} ssl crt {pem} alpn h2,http/1.1"
    return substituted(
        text,
        [
            (r"bind :8080", f"bind 127.0.0.1:{port}"),
            (r"bind :8443 ssl crt \S+ alpn h2,http/1\.1", tls_bind),
            (r"server app 127\.0\.0\.1:8000", f"server app {upstream_of(app_url)}"),
        ],
    )


async def test_defaults_send_a_stream_in_200_ms_bursts_named_for_http_no_delay(tmp_path):
    # HAProxy sends a response it has not seen the end of with MSG_MORE; Linux holds those
    # writes for up to 200 ms, whatever the events' size.
    async with serve_engine_at() as app_url:
        port = free_port()
        async with running_haproxy(frontend(port, upstream_of(app_url)), port, tmp_path) as url:
            held, ws = await asyncio.gather(doctor(url), websocket_reply(url))
        port = free_port()
        options = "    option http-no-delay\n"
        config = frontend(port, upstream_of(app_url), options)
        async with running_haproxy(config, port, tmp_path / "no-delay") as url:
            passed = await doctor(url)
    assert held.verdict == "bursty", held.reason
    assert held.hop is not None and "HAProxy without option http-no-delay" in held.hop
    assert held.fix is not None and held.fix.startswith("option http-no-delay")
    assert max(b.approx_bytes for b in held.bursts) < 2048  # no proxy buffer's fill
    assert passed.verdict == "streaming", passed.reason
    assert ws == "done"  # HAProxy passes the upgrade on as it is


async def test_deploy_config_streams_and_passes_the_websocket_on(tmp_path):
    async with serve_engine_at() as app_url:
        port = free_port()
        async with running_haproxy(deploy_config(app_url, port), port, tmp_path) as url:
            stream, ws = await asyncio.gather(doctor(url), websocket_reply(url))
    assert stream.verdict == "streaming", stream.reason
    assert ws == "done"
    log = (tmp_path / "out.log").read_text()
    assert "WARNING" not in log and "ALERT" not in log, log  # every line of it is in force


async def test_a_client_that_leaves_during_prefill_cancels_at_once_with_abortonclose(tmp_path):
    # The app is silent for 20 s before its first token, keep-alives every 15 s. HAProxy's
    # defaults take the client's close for a half-close and tell the app nothing until a
    # keep-alive fails to reach the client; the deploy config closes the app's connection.
    engine = long_reply_engine(first_token_ms=20_000.0)
    async with running(create_app(engine)) as app_url:
        port = free_port()
        async with running_haproxy(frontend(port, upstream_of(app_url)), port, tmp_path) as url:
            defaults = await leave_during_prefill(url, engine, limit_s=3.0)
        port = free_port()
        config = deploy_config(app_url, port)
        async with running_haproxy(config, port, tmp_path / "deploy") as url:
            deployed = await leave_during_prefill(url, engine, limit_s=10.0)
    assert defaults >= 3.0  # still generating for a client long gone
    assert deployed < 2.0


async def test_keepalives_hold_a_silent_stream_past_the_idle_timeouts(tmp_path):
    # The deploy config's timeouts at a 30th (50 s -> 1.7 s), the keep-alive likewise
    # (15 s -> 0.5 s): a 5 s prefill streams through; without keep-alives it is cut.
    def haproxy(app_url: str, port: int, tmp: Path) -> AbstractAsyncContextManager[str]:
        text = substituted(
            deploy_config(app_url, port),
            [
                (r"timeout client 50s", "timeout client 1700ms"),
                (r"timeout server 50s", "timeout server 1700ms"),
                (r"timeout server 1h", "timeout server 1700ms"),
            ],
        )
        return running_haproxy(text, port, tmp)

    await assert_keepalives_hold_a_silent_prefill(haproxy, tmp_path)


async def test_deploy_config_names_each_client_to_the_app(tmp_path):
    # option forwardfor adds its own X-Forwarded-For line after any the client sent: the app
    # must read the last line, not the client's, or one client can pose as another.
    schedule = ("--engine", "simulated", "--delay-ms", "25", "--jitter-ms", "0", "--tokens", "40")
    guard = ("--trusted-proxy", "127.0.0.1", "--max-concurrent-per-client", "1")
    async with replica(*schedule, *guard) as (_, app_url):
        port = free_port()
        async with running_haproxy(deploy_config(app_url, port), port, tmp_path) as url:
            two_clients = await asyncio.gather(
                stream_status_from("127.0.0.2", url), stream_status_from("127.0.0.3", url)
            )
            one_posing_as_the_other = await asyncio.gather(
                stream_status_from("127.0.0.2", url),
                stream_status_from("127.0.0.3", url, forged_for="127.0.0.2"),
            )
    assert list(two_clients) == [200, 200]
    assert list(one_posing_as_the_other) == [200, 200]


async def stream_status_from(address: str, url: str, forged_for: str | None = None) -> int:
    """Read one whole stream from ``url`` over a connection from ``address``; its status."""
    headers = {"X-Forwarded-For": forged_for} if forged_for else {}
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get(f"{url}/stream", headers=headers) as response,
    ):
        await response.read()
        return response.status


def serve_engine_at() -> contextlib.AbstractAsyncContextManager[str]:
    """The app serving the 400-token engine, in this process."""
    return running(create_app(long_reply_engine()))
