"""docs/deploy/haproxy.cfg's and apache.conf's TLS listeners over HTTP/2, with curl and headless
Chromium, as docs/deploy/proxies.md's "HTTP/2 to browsers" tells them (nginx.conf's beside
them where tests/test_nginx_http2.py does not cover it).

Each test starts the app, the real proxy running the deploy file with its TLS listener and a
certificate made here, and an HTTP/2 client: events must arrive one by one, not buffered; eight
streams share one connection (HAProxy starts them at once, Apache's mod_http2 six of them);
a client's reset of one stream reaches the app as a cancel while the others go on (nginx and
HAProxy at once, Apache at its next write to the stream, even while the app is silent); the
WebSocket transport works from the TLS site.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.browser import chromium
from tests.nginx import SiteTls, running_nginx
from tests.nginx import deploy_config as nginx_config
from tests.processes import replica
from tests.proxies import running_apache, running_haproxy
from tests.services import free_port, require_binary
from tests.test_apache import deploy_config as apache_config
from tests.test_bench_tls import make_certificates
from tests.test_haproxy import deploy_config as haproxy_config
from tests.test_nginx_http2 import CLOSE_ONE, WEBSOCKET_REPLY, Site, run_on_page

PROXIES = ("haproxy", "apache")
# 50 tokens 20 ms apart: each reply takes about a second.
SCHEDULE = ("--engine", "simulated", "--delay-ms", "20", "--jitter-ms", "0", "--tokens", "50")


@contextlib.asynccontextmanager
async def tls_site(proxy: str, tmp: Path, *app_args: str) -> AsyncIterator[Site]:
    """The app (``replystream serve`` with ``app_args``) behind ``proxy`` running its deploy
    file, the TLS listener on with a certificate for localhost."""
    _, certificate, key = make_certificates(tmp / "certs")
    tls = SiteTls(free_port(), certificate, key)
    async with replica(*app_args, "--trusted-proxy", "127.0.0.1") as (_, app_url):
        port = free_port()
        if proxy == "nginx":
            running = running_nginx(nginx_config(app_url, port, tls), port, tmp / proxy)
        elif proxy == "haproxy":
            config = haproxy_config(app_url, port, tls)
            running = running_haproxy(config, port, tmp / proxy)
        else:
            config = apache_config(app_url, port, tls)
            running = running_apache(config, port, tmp / proxy, tls_port=tls.port)
        async with running as http_url:
            yield Site(app_url, http_url, f"https://127.0.0.1:{tls.port}")


async def curl(*args: str) -> asyncio.subprocess.Process:
    """curl over HTTP/2 (TLS unverified: the certificate is the test's own), its output piped."""
    binary = require_binary("curl")
    command = [binary, "--silent", "--insecure", "--http2", "--no-buffer", *args]
    return await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)


async def text_arrivals(url: str) -> tuple[str, list[float]]:
    """Read one stream from ``url``: the HTTP version it came over, and when each text came."""
    process = await curl("--write-out", "\nversion %{http_version}\n", url)
    assert process.stdout is not None
    arrivals, version = [], ""
    async with asyncio.timeout(30):
        async for line in process.stdout:
            if line.startswith(b'data: "'):
                arrivals.append(time.monotonic())
            elif line.startswith(b"version "):
                version = line.split()[1].decode()
        await process.wait()
    return version, arrivals


async def parallel_streams(url: str, count: int) -> tuple[int, list[tuple[float, float]]]:
    """Read ``count`` streams from ``url`` at once over HTTP/2: the connections curl made, and
    for each stream when its head came and when it ended (s from its start)."""
    outputs = [arg for _ in range(count) for arg in ("--output", "/dev/null", url)]
    out_format = "%{num_connects} %{time_starttransfer} %{time_total}\n"
    process = await curl("--parallel", "--parallel-max", str(count), "-w", out_format, *outputs)
    stdout, _ = await asyncio.wait_for(process.communicate(), 30)
    rows = [line.split() for line in stdout.decode().splitlines()]
    assert len(rows) == count, stdout
    connects = sum(int(row[0]) for row in rows)
    return connects, [(float(row[1]), float(row[2])) for row in rows]


@pytest.mark.parametrize("proxy", PROXIES)
async def test_over_http2_each_event_arrives_as_it_is_written(proxy: str, tmp_path: Path) -> None:
    async with tls_site(proxy, tmp_path, *SCHEDULE) as site:
        version, arrivals = await text_arrivals(f"{site.https_url}/stream?max_tokens=50")
    assert version == "2"
    assert len(arrivals) == 50
    # Written 20 ms apart over a second: a proxy that held them would hand them on in a few
    # bursts (most of them 0 ms apart), or all at the end.
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert arrivals[-1] - arrivals[0] > 0.7, gaps
    assert statistics.median(gaps) > 0.010, gaps


# Streams that waited for another to end before their head came: mod_http2 serves six requests
# of a new connection at once, more only as requests on it end.
WAITED = {"haproxy": 0, "apache": 2}


@pytest.mark.parametrize("proxy", PROXIES)
async def test_eight_streams_share_one_http2_connection(proxy: str, tmp_path: Path) -> None:
    async with tls_site(proxy, tmp_path, *SCHEDULE) as site:
        connects, streams = await parallel_streams(f"{site.https_url}/stream?max_tokens=50", 8)
    assert connects == 1
    first_end = min(end for _, end in streams)
    # A reply takes about a second: a stream that started at once has its head in a few ms.
    waited = [stream for stream in streams if stream[0] > first_end / 2]
    assert len(waited) == WAITED[proxy], streams


@pytest.mark.parametrize("proxy", PROXIES)
async def test_closing_one_http2_stream_cancels_its_reply_alone(proxy: str, tmp_path: Path) -> None:
    async with tls_site(proxy, tmp_path, *SCHEDULE) as site:
        assert await run_on_page(site.https_url, CLOSE_ONE) == [1, 50]
        # The browser's reset of the one stream reached the app as its connection closed.
        assert await site.outcomes() == {"cancelled": 1.0, "finished": 1.0}


# Two EventSources on one connection; the first is closed as soon as its reply begins (the
# app still silent in a long prefill), the second left open. Run in a page left open.
CLOSE_ONE_IN_PREFILL = """() => new Promise((resolve) => {
  const closed = new EventSource('/stream?max_tokens=5');
  closed.addEventListener('reply', () => { closed.close(); resolve(); });
  window.left_open = new EventSource('/stream?max_tokens=5');
})"""

# How long after the reset the app cancels the reply: at once, or at the app's next write (a
# keep-alive every 3 s).
CANCELLED_WITHIN = {"nginx": (0.0, 1.5), "haproxy": (0.0, 1.5), "apache": (1.5, 6.0)}


async def seconds_until_cancelled(site: Site, limit_s: float) -> float:
    """How long until the app counts a reply cancelled (``limit_s`` if it does not)."""
    started = time.monotonic()
    # The app's count, read over HTTP: there is no state in this process to wait on.
    while (await site.outcomes()).get("cancelled") != 1.0:
        if time.monotonic() - started >= limit_s:
            break
        await asyncio.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.parametrize("proxy", ("nginx", *PROXIES))
async def test_a_stream_reset_while_the_app_is_silent(proxy: str, tmp_path: Path) -> None:
    silent = ("--engine", "simulated", "--first-token-ms", "20000", "--keepalive-s", "3")
    async with tls_site(proxy, tmp_path, *silent) as site, chromium() as browser:
        context = await browser.new_context(ignore_https_errors=True)
        page = await context.new_page()
        await page.goto(f"{site.https_url}/")
        await page.evaluate(CLOSE_ONE_IN_PREFILL)
        waited = await seconds_until_cancelled(site, limit_s=10)
        assert await site.outcomes() == {"cancelled": 1.0}  # the other one goes on
        await context.close()
    low, high = CANCELLED_WITHIN[proxy]
    assert low <= waited < high


@pytest.mark.parametrize("proxy", PROXIES)
async def test_the_websocket_transport_works_from_the_tls_listener(
    proxy: str, tmp_path: Path
) -> None:
    async with tls_site(proxy, tmp_path, *SCHEDULE) as site:
        assert await run_on_page(site.https_url, WEBSOCKET_REPLY) == "done"
