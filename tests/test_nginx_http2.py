"""docs/deploy/nginx.conf's TLS listener, in a real browser: event streams over HTTP/2.

Over HTTP/1.1 a browser opens at most six connections to a site, and each open event stream
holds one: a seventh stream waits, silent, until another ends. Over HTTP/2 they share one
connection. Headless Chromium opens eight EventSources through a real nginx running the
deploy file, on its plain listener and on its TLS one, and one stream is closed mid-reply to
see that the reset of one HTTP/2 stream reaches the app as a cancel, and the others go on.
The WebSocket transport, which nginx takes over HTTP/1.1 alone, works from the TLS listener.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.browser import chromium
from tests.nginx import SiteTls, deploy_config, running_nginx
from tests.processes import replica
from tests.services import free_port
from tests.test_bench_tls import make_certificates

STREAMS = 8
# 50 tokens 20 ms apart: each reply takes about a second, long past the time eight streams
# take to open, so a stream that waited for a connection shows it.
SCHEDULE = ("--engine", "simulated", "--delay-ms", "20", "--jitter-ms", "0", "--tokens", "50")

# Opens `count` EventSources at once; for each, when its first text and its end came (ms).
OPEN_STREAMS = """async (count) => {
  const started = performance.now();
  const opened = Array.from({length: count}, () => new Promise((resolve, reject) => {
    const source = new EventSource('/stream?max_tokens=50');
    let first = null;
    source.onmessage = (event) => {
      const now = performance.now() - started;
      if (event.data === '[DONE]') {
        source.close();
        resolve({first, end: now});
      } else if (first === null) {
        first = now;
      }
    };
    source.onerror = () => { source.close(); reject(new Error('a stream failed')); };
  }));
  return {
    protocol: performance.getEntriesByType('navigation')[0].nextHopProtocol,
    streams: await Promise.all(opened),
  };
}"""

# Two EventSources on one connection: the first is closed after its first text, the second
# is read to its end; says how many texts each got.
CLOSE_ONE = """async () => {
  const texts = [0, 0];
  const closed = new Promise((resolve) => {
    const source = new EventSource('/stream?max_tokens=50');
    source.onmessage = () => { texts[0] += 1; source.close(); resolve(); };
  });
  const read = new Promise((resolve, reject) => {
    const source = new EventSource('/stream?max_tokens=50');
    source.onmessage = (event) => {
      if (event.data === '[DONE]') { source.close(); resolve(); } else { texts[1] += 1; }
    };
    source.onerror = () => { source.close(); reject(new Error('the other stream failed')); };
  });
  await Promise.all([closed, read]);
  return texts;
}"""


# One reply over the WebSocket transport from the page; how it ended.
WEBSOCKET_REPLY = """() => new Promise((resolve, reject) => {
  const socket = new WebSocket(location.origin.replace('https:', 'wss:') + '/v1/ws');
  socket.onopen = () => socket.send(JSON.stringify({type: 'reply', id: 'q', prompt: 'Hi'}));
  socket.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.type === 'done' || message.type === 'error') {
      socket.close();
      resolve(message.type);
    }
  };
  socket.onerror = () => reject(new Error('the socket failed'));
})"""


class Site:
    def __init__(self, app_url: str, http_url: str, https_url: str) -> None:
        self.app_url = app_url
        self.http_url = http_url
        self.https_url = https_url

    async def outcomes(self) -> dict[str, float]:
        """The app's count of /stream replies by how each ended."""
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{self.app_url}/metrics") as response:
                text = await response.text()
        pattern = r'replystream_replies_total\{endpoint="/stream",outcome="(\w+)"\} (\S+)'
        return {outcome: float(count) for outcome, count in re.findall(pattern, text)}


@pytest.fixture
async def site(tmp_path: Path) -> AsyncIterator[Site]:
    _, certificate, key = make_certificates(tmp_path / "certs")
    tls = SiteTls(free_port(), certificate, key)
    async with replica(*SCHEDULE, "--trusted-proxy", "127.0.0.1") as (_, app_url):
        port = free_port()
        config = deploy_config(app_url, port, tls)
        async with running_nginx(config, port, tmp_path / "nginx") as http_url:
            yield Site(app_url, http_url, f"https://127.0.0.1:{tls.port}")


async def run_on_page(url: str, script: str, *argument: object) -> Any:
    """``script``'s result, run in Chromium on the chat page at ``url``."""
    async with chromium() as browser:
        context = await browser.new_context(ignore_https_errors=True)
        page = await context.new_page()
        await page.goto(f"{url}/")
        result = await page.evaluate(script, *argument)
        await context.close()
    return result


async def test_over_http2_every_stream_starts_at_once(site: Site) -> None:
    result = await run_on_page(site.https_url, OPEN_STREAMS, STREAMS)
    assert result["protocol"] == "h2"
    streams = result["streams"]
    first_end = min(stream["end"] for stream in streams)
    assert all(stream["first"] < first_end for stream in streams), streams


async def test_the_websocket_transport_works_from_the_tls_listener(site: Site) -> None:
    # nginx 1.22 takes no WebSocket over HTTP/2: the browser opens an HTTP/1.1 connection
    # for it beside the page's HTTP/2 one, and the file's /v1/ws location passes it on.
    assert await run_on_page(site.https_url, WEBSOCKET_REPLY) == "done"


async def test_over_http11_a_seventh_stream_waits_for_a_connection(site: Site) -> None:
    # What the TLS listener is for: the same page on the plain listener.
    result = await run_on_page(site.http_url, OPEN_STREAMS, STREAMS)
    assert result["protocol"] == "http/1.1"
    streams = result["streams"]
    first_end = min(stream["end"] for stream in streams)
    waited = [stream for stream in streams if stream["first"] >= first_end]
    assert len(waited) == STREAMS - 6, streams


async def test_closing_one_http2_stream_cancels_its_reply_alone(site: Site) -> None:
    assert await run_on_page(site.https_url, CLOSE_ONE) == [1, 50]
    # The browser's reset of the one stream reached the app as its connection closed.
    assert await site.outcomes() == {"cancelled": 1.0, "finished": 1.0}
