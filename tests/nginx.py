"""Run a real nginx for a test: a non-daemon child with its own config, logs and temp paths.

Everything nginx writes (pid file, error log, temp files) lives in the test's tmp dir, and
``master_process off`` keeps it one process, so stopping the child stops nginx.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from replystream.lab.local_server import stop_process
from tests.services import REQUIRE_ENV, require_binary, services_required, wait_listening

_MAIN = """daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
{http}
}}
"""

_PROXY = """    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://{upstream};
{location}
        }}
    }}"""

# Explicit 4 KiB buffers, so the buffered cases behave the same on every page size.
SMALL_BUFFERS = "proxy_buffer_size 4k; proxy_buffers 8 4k; proxy_busy_buffers_size 8k;"

# The location directives of each configuration under test.
LOCATIONS = {
    # nginx's default, with the app's X-Accel-Buffering: no ignored.
    "buffering_on": f"proxy_buffering on; proxy_ignore_headers X-Accel-Buffering; {SMALL_BUFFERS}",
    "buffering_off": "proxy_buffering off;",
    # Buffering on, but nginx honours the app's X-Accel-Buffering: no (its default).
    "accel_honoured": f"proxy_buffering on; {SMALL_BUFFERS}",
    "gzip": "proxy_buffering off; gzip on; gzip_types text/event-stream;",
    # Buffers larger than the whole reply: nothing leaves before the reply ends.
    "large_buffers": (
        "proxy_buffering on; proxy_ignore_headers X-Accel-Buffering; "
        "proxy_buffer_size 64k; proxy_buffers 8 64k; proxy_busy_buffers_size 128k;"
    ),
}


def proxy_config(upstream: str, port: int, location: str) -> str:
    """An http-context server block proxying ``127.0.0.1:port`` to ``upstream`` (host:port).

    Everything not in ``location`` keeps nginx's defaults, including HTTP/1.0 to the upstream
    (with ``proxy_http_version 1.1`` and a chunked upstream response, nginx 1.22 was seen to
    pass chunks on despite ``proxy_buffering on``; the default is what most sites run).
    """
    return _PROXY.format(port=port, upstream=upstream, location=f"            {location}")


DEPLOY_CONFIG = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "nginx.conf"


@dataclass(frozen=True)
class SiteTls:
    """Where the deploy file's TLS listener runs in a test: its port, certificate and key."""

    port: int
    certificate: Path
    key: Path


def deploy_config(app_url: str, port: int, tls: SiteTls | None = None) -> str:
    """docs/deploy/nginx.conf with its listen port and upstream address substituted.

    With ``tls`` its TLS listener (HTTP/2) is on ``tls.port`` with that certificate; without,
    the TLS lines are left out, as a site without a certificate would.
    """
    text = DEPLOY_CONFIG.read_text()
    counts = []
    for pattern, value in (
        (r"listen 8080;", f"listen 127.0.0.1:{port};"),
        (r"server 127\.0\.0\.1:8000;", f"server {urlsplit(app_url).netloc};"),
        (r"listen 8443 ssl http2;", tls and f"listen 127.0.0.1:{tls.port} ssl http2;"),
        (r"ssl_certificate +\S+;", tls and f"ssl_certificate {tls.certificate};"),
        (r"ssl_certificate_key +\S+;", tls and f"ssl_certificate_key {tls.key};"),
    ):
        text, count = re.subn(pattern, value or "", text)
        counts.append(count)
    assert counts == [1] * 5, counts
    return text


def _write_config(http_config: str, tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    conf = tmp / "nginx.conf"
    conf.write_text(_MAIN.format(tmp=tmp, http=http_config))
    return conf


@contextlib.asynccontextmanager
async def running_nginx(http_config: str, port: int, tmp: Path) -> AsyncIterator[str]:
    """Start nginx with ``http_config`` inside its http block; yield ``http://127.0.0.1:port``.

    ``http_config`` must listen on ``127.0.0.1:port``.
    """
    async with _running(_write_config(http_config, tmp), port, tmp):
        yield f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _running(conf: Path, port: int, tmp: Path) -> AsyncIterator[None]:
    """nginx with ``conf``, listening on ``port``, until the block ends."""
    binary = require_binary("nginx")
    error_log = tmp / "error.log"
    process = await asyncio.create_subprocess_exec(
        binary, "-p", str(tmp), "-c", str(conf), "-e", str(error_log)
    )
    try:
        await wait_listening("nginx", port, process, error_log, timeout_s=15)
        yield
    finally:
        await stop_process(process)


# Debian's libnginx-mod-stream: nginx's TCP and TLS proxying, a module loaded by path.
STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")

_STREAM_MAIN = """load_module {module};
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
stream {{
{stream}
}}
"""


def _write_stream_config(stream_config: str, tmp: Path) -> Path:
    if not STREAM_MODULE.exists():
        reason = "nginx's stream module is not installed (Debian package libnginx-mod-stream)"
        if services_required():
            pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires it")
        pytest.skip(reason)
    tmp.mkdir(parents=True, exist_ok=True)
    conf = tmp / "nginx.conf"
    conf.write_text(_STREAM_MAIN.format(module=STREAM_MODULE, tmp=tmp, stream=stream_config))
    return conf


@contextlib.asynccontextmanager
async def running_nginx_stream(stream_config: str, port: int, tmp: Path) -> AsyncIterator[None]:
    """Start nginx with ``stream_config`` as its stream block (which must listen on
    ``127.0.0.1:port``), until the block ends."""
    require_binary("nginx")  # before the stream module: the package it comes with
    async with _running(_write_stream_config(stream_config, tmp), port, tmp):
        yield
