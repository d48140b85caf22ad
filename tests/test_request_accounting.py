"""What the server tells of each request: ``/metrics`` counts each body as it went on the
wire (gzipped when it was; an error answered before the first token too)."""

from __future__ import annotations

import gzip
import json
import re
from typing import Any

import pytest

from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.rawhttp import RawResponse, raw_request

CHAT = [{"role": "user", "content": "x"}]


async def post(
    url: str, path: str, body: dict[str, Any], request_id: str, **headers: str
) -> RawResponse:
    sent = {"Content-Type": "application/json", "X-Request-Id": request_id, **headers}
    return await raw_request(f"{url}{path}", "POST", json.dumps(body).encode(), sent)


def sent_total(metrics: bytes, series: str, endpoint: str) -> float:
    found = re.search(
        rb'replystream_%s_total\{endpoint="%s"\} (\S+)' % (series.encode(), endpoint.encode()),
        metrics,
    )
    return float(found.group(1)) if found else 0.0


async def metrics_of(url: str) -> bytes:
    return await (await raw_request(f"{url}/metrics")).read_body()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/replies"])
async def test_a_whole_reply_counts_the_bytes_that_went_on_the_wire(path: str):
    """A body gzipped for its client counts its gzipped bytes, not the plain ones it was made
    from (which were counted though far fewer went out)."""
    engine = fast_engine(delay_ms=0.0, jitter_ms=0.0, reply_text="word " * 400)
    asks = {
        "/v1/chat/completions": {"messages": CHAT, "max_tokens": 400},
        "/v1/responses": {"input": "x", "max_output_tokens": 400},
        "/v1/replies": {"prompt": "x", "max_tokens": 400, "stream": False},
    }
    async with running(create_app(engine)) as url:
        zipped = await post(url, path, asks[path], "zipped", **{"Accept-Encoding": "gzip"})
        wire = await zipped.read_body()
        plain = await (await post(url, path, asks[path], "plain")).read_body()
        metrics = await metrics_of(url)
    assert zipped.headers["content-encoding"] == "gzip"
    assert len(gzip.decompress(wire)) > 4 * len(wire)
    assert sent_total(metrics, "bytes_sent", path) == len(wire) + len(plain)
    assert sent_total(metrics, "events_sent", path) == 2


@pytest.mark.parametrize(
    ("path", "ask"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
        ("/v1/messages", {"messages": CHAT, "stream": True, "model": "simulated", "max_tokens": 9}),
        ("/v1/responses", {"input": "x", "stream": True}),
        ("/v1/replies", {"prompt": "x"}),
    ],
)
async def test_an_error_answered_before_the_first_token_counts_as_sent(path, ask):
    """A stream whose engine fails as it starts is answered with an error body in its
    route's shape, before any event: written to its client as a whole reply's body is, and
    counted so (one event, its bytes), where it was counted nowhere."""
    async with running(create_app(fast_engine(fail_after=0))) as url:
        failed = await post(url, path, ask, "failed")
        body = await failed.read_body()
        metrics = await metrics_of(url)
    assert failed.status == 500 and b"simulated failure" in body
    assert sent_total(metrics, "bytes_sent", path) == len(body)
    assert sent_total(metrics, "events_sent", path) == 1
