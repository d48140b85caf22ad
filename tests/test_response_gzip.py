"""Finished answers (JSON, HTML, plain text) are gzipped for clients that take gzip, at zlib's
fastest level."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import threading

import pytest
from aiohttp import web

from replystream.server import create_app, response_gzip, running
from replystream.server.response_gzip import IN_THREAD_BYTES, STEP_BYTES, accepts_gzip, gzipped
from tests.conftest import fast_engine
from tests.rawhttp import raw_request

# 80 tokens of 4,000 characters: an answer past IN_THREAD_BYTES, made in a few milliseconds.
LONG_REPLY = " ".join(["y" * 4000] * 80)
# The gzip header's XFL byte (RFC 1952): 4 says the compressor used its fastest algorithm.
FASTEST = 4


@pytest.mark.parametrize(
    ("header", "taken"),
    [
        ("gzip", True),
        ("gzip, deflate, br, zstd", True),
        ("GZip;Q=0.5", True),
        ("x-gzip", True),
        ("deflate, gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("gzip;q=nonsense", False),
        ("br", False),
        ("", False),
        ("identity", False),
        ("*", True),
        ("*;q=0", False),
        ("gzip;q=0, *", False),  # named, gzip's own weight decides
        ("*;q=0, gzip", True),
        ("deflate;q=1, gzip ;q=0.1", True),
    ],
)
def test_accept_encoding_is_read_with_its_weights(header: str, taken: bool) -> None:
    assert accepts_gzip(header) is taken


async def _chat(url: str, accept: str | None) -> tuple[dict[str, str], bytes]:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"Content-Type": "application/json"}
    if accept is not None:
        headers["Accept-Encoding"] = accept
    response = await raw_request(f"{url}/v1/chat/completions", "POST", body, headers)
    assert response.status == 200
    return response.headers, await response.read_body()


@pytest.mark.parametrize(
    "reply_text", [" ".join(["a few words"] * 100), LONG_REPLY], ids=["small", "large"]
)
async def test_an_answer_is_gzipped_at_the_fastest_level(reply_text: str) -> None:
    """Small (compressed on the loop) and large (in a worker thread): the same form."""
    engine = fast_engine(reply_text=reply_text, delay_ms=0.1, jitter_ms=0)
    async with running(create_app(engine)) as url:
        headers, body = await _chat(url, "gzip, deflate")
        plain_headers, plain = await _chat(url, None)
    assert headers["content-encoding"] == "gzip"
    assert headers["vary"] == "Accept-Encoding"
    assert body[:2] == b"\x1f\x8b" and body[8] == FASTEST
    assert int(headers["content-length"]) == len(body)
    text = json.loads(gzip.decompress(body))["choices"][0]["message"]["content"]
    assert text.strip() == reply_text
    assert "content-encoding" not in plain_headers
    assert plain_headers["vary"] == "Accept-Encoding"
    assert json.loads(plain)["choices"][0]["message"]["content"] == text
    assert (len(plain) >= IN_THREAD_BYTES) is (reply_text == LONG_REPLY)
    assert len(body) < len(plain)


async def test_a_client_that_refuses_gzip_by_weight_gets_the_answer_plain() -> None:
    engine = fast_engine(reply_text=LONG_REPLY, delay_ms=0.1, jitter_ms=0)
    async with running(create_app(engine)) as url:
        headers, body = await _chat(url, "gzip;q=0, deflate")
    assert "content-encoding" not in headers
    # Its form was chosen by the request's Accept-Encoding: a cache must key it by that too.
    assert headers["vary"] == "Accept-Encoding"
    assert json.loads(body)["choices"][0]["message"]["content"].strip() == LONG_REPLY


async def test_the_metrics_a_scraper_asks_for_gzipped_come_gzipped() -> None:
    async with running(create_app(fast_engine())) as url:
        response = await raw_request(f"{url}/metrics", headers={"Accept-Encoding": "gzip"})
        body = await response.read_body()
    assert response.status == 200
    assert response.headers["content-encoding"] == "gzip"
    assert response.headers["content-type"].startswith("text/plain")
    assert b"# HELP replystream_" in gzip.decompress(body)


async def test_a_length_the_handler_set_becomes_the_compressed_bodys() -> None:
    """A handler that set the plain body's Content-Length: the client is told the compressed
    body's, and reads exactly that body."""
    plain = json.dumps({"items": [f"item {i}" for i in range(2000)]}).encode()

    async def sized(_: web.Request) -> web.Response:
        return web.Response(
            body=plain, content_type="application/json", headers={"Content-Length": str(len(plain))}
        )

    app = create_app(fast_engine())
    app.router.add_get("/sized", sized)
    async with running(app) as url:
        response = await raw_request(f"{url}/sized", headers={"Accept-Encoding": "gzip"})
        body = await response.read_body()
    assert response.headers["content-encoding"] == "gzip"
    assert int(response.headers["content-length"]) == len(body) < len(plain)
    assert gzip.decompress(body) == plain


def test_a_large_body_compressed_a_step_at_a_time_is_gzip_and_stops_when_told() -> None:
    body = os.urandom(STEP_BYTES // 2) * 5  # five steps and a half, some of it repeated
    assert gzip.decompress(gzipped(body, threading.Event())) == body
    stop = threading.Event()
    stop.set()
    assert gzipped(body, stop) == b""


async def test_a_client_that_leaves_stops_its_answers_compression(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compression in its worker thread is told to stop when the request is cancelled
    (its client gone), rather than run to the end of a body nobody will read."""
    entered, told = threading.Event(), threading.Event()

    def watched(body: bytes, stop: threading.Event | None = None) -> bytes:
        assert stop is not None
        entered.set()
        if stop.wait(10.0):
            told.set()
        return b""

    monkeypatch.setattr(response_gzip, "gzipped", watched)
    plain = json.dumps({"items": ["x" * 100] * 4000}).encode()  # past IN_THREAD_BYTES

    async def large(_: web.Request) -> web.Response:
        return web.Response(body=plain, content_type="application/json")

    app = create_app(fast_engine())
    app.router.add_get("/large", large)
    async with running(app) as url:
        host, port = url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /large HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        await writer.drain()
        assert await asyncio.to_thread(entered.wait, 10.0)
        writer.close()  # gone before the answer
        await writer.wait_closed()
        assert await asyncio.to_thread(told.wait, 10.0)
