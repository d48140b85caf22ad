"""Apache httpd (mod_proxy_http) in front of the real server: its defaults stream but refuse
the WebSocket upgrade, mod_deflate on the event stream is not taken for a held stream,
docs/deploy/apache.conf streams and passes the WebSocket transport on, a client that leaves is
noticed at the second keep-alive, and the keep-alives hold a silent stream past ProxyTimeout."""

from __future__ import annotations

import asyncio
import re
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from replystream.delivery.policy import DeliveryPolicy
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.nginx import SiteTls
from tests.proxies import (
    DEPLOY,
    assert_keepalives_hold_a_silent_prefill,
    doctor,
    leave_during_prefill,
    long_reply_engine,
    running_apache,
    substituted,
    websocket_reply,
)
from tests.services import free_port


def plain(app_url: str, more: str = "") -> str:
    """The least a site needs to proxy to the app, and ``more``."""
    return f"ProxyPass / {app_url}/\n{more}\n"


def deploy_config(app_url: str, port: int, tls: SiteTls | None = None) -> str:
    """docs/deploy/apache.conf with its port and the app's address substituted.

    With ``tls`` its TLS site (HTTP/2) is on ``tls.port`` with that certificate (for
    ``running_apache(..., tls_port=tls.port)``); without, the site is left out, as a server
    without a certificate would.
    """
    text = (DEPLOY / "apache.conf").read_text()
    if tls is None:
        text = substituted(text, [(r"(?s)\n# Browsers speak HTTP/2 .*</VirtualHost>\n", "")])
    else:
        text = substituted(
            text,
            [
                (r"<VirtualHost \*:8443>", f"<VirtualHost 127.0.0.1:{tls.port}>"),
                (r"SSLCertificateFile +\S+", f"SSLCertificateFile {tls.certificate}"),
                (r"SSLCertificateKeyFile +\S+", f"SSLCertificateKeyFile {tls.key}"),
            ],
        )
    text = substituted(text, [(r"<VirtualHost \*:8080>", f"<VirtualHost 127.0.0.1:{port}>")])
    # Each site's proxy lines.
    text, count = re.subn(
        r"(?m)^( +Proxy\S+ /\S* )http://127\.0\.0\.1:8000", rf"\g<1>{app_url}", text
    )
    assert count == (3 if tls is None else 6), count
    return text


async def test_defaults_stream_but_refuse_the_websocket_upgrade(tmp_path):
    async with running(create_app(long_reply_engine())) as app_url:
        port = free_port()
        async with running_apache(plain(app_url), port, tmp_path) as url:
            stream, ws = await asyncio.gather(doctor(url), websocket_reply(url))
    assert stream.verdict == "streaming", stream.reason
    assert ws == "refused 400"  # mod_proxy_http drops Upgrade without upgrade=websocket


async def test_mod_deflate_flushing_every_event_is_a_stream_not_a_held_one(tmp_path):
    # mod_deflate flushes its compressor whenever mod_proxy_http flushes, which it does
    # whenever the app has nothing more ready: every event arrives compressed, on time.
    async with running(create_app(long_reply_engine())) as app_url:
        port = free_port()
        async with running_apache(plain(app_url, "SetOutputFilter DEFLATE"), port, tmp_path) as url:
            result = await doctor(url)
    assert result.headers["content-encoding"] == "gzip"
    assert result.verdict == "streaming", result.reason
    assert "compressed (gzip) and flushed after every event" in result.reason
    assert result.first_text_ms is not None and result.first_text_ms < 1000


async def test_deploy_config_streams_and_passes_the_websocket_on(tmp_path):
    async with running(create_app(long_reply_engine())) as app_url:
        port = free_port()
        async with running_apache(deploy_config(app_url, port), port, tmp_path) as url:
            stream, ws = await asyncio.gather(doctor(url), websocket_reply(url))
    assert stream.verdict == "streaming", stream.reason
    assert ws == "done"
    log = (tmp_path / "error.log").read_text()
    assert "[proxy" not in log and ":warn]" not in log, log


async def test_a_client_that_leaves_during_prefill_is_noticed_at_the_second_keepalive(tmp_path):
    # Apache reads nothing from the client while it passes a reply on: it learns the client
    # left when a write to it fails, the second after it left. With keep-alives every 15 s a
    # generation runs on for a gone client; with every 0.5 s, about a second.
    engine = long_reply_engine(first_token_ms=20_000.0)
    waited = {}
    for keepalive_s in (15.0, 0.5):
        config = ServerConfig(policy=DeliveryPolicy(keepalive_s=keepalive_s))
        async with running(create_app(engine, config)) as app_url:
            port = free_port()
            site = deploy_config(app_url, port)
            async with running_apache(site, port, tmp_path / str(keepalive_s)) as url:
                waited[keepalive_s] = await leave_during_prefill(url, engine, limit_s=3.0)
    assert waited[15.0] >= 3.0
    assert waited[0.5] < 2.5


async def test_keepalives_hold_a_silent_stream_past_proxy_timeout(tmp_path):
    # ProxyTimeout at 2 s, keep-alives every 0.5 s: a 5 s prefill streams through; without
    # keep-alives Apache gives up on the app and the stream is cut.
    def apache(app_url: str, port: int, tmp: Path) -> AbstractAsyncContextManager[str]:
        site = substituted(deploy_config(app_url, port), [("ProxyTimeout 3600", "ProxyTimeout 2")])
        return running_apache(site, port, tmp)

    await assert_keepalives_hold_a_silent_prefill(apache, tmp_path)
