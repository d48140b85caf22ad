"""``Expect: 100-continue``: the body is invited only once the front door's checks that need
no body have passed; a request refused before that is answered at once, in its route's error
shape, and its connection closed (the body it holds back must not be read as a request)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine

KEY = "sk-expect"
LIMIT = 100_000
UPLOAD = 3 * 1024 * 1024  # what a refused client would have sent for nothing


@asynccontextmanager
async def server() -> AsyncIterator[tuple[str, int]]:
    config = ServerConfig(api_keys=(KEY,), max_body_bytes=LIMIT, guard=GuardConfig())
    async with running(create_app(fast_engine(), config)) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


class Exchange:
    """One connection, driven by hand: the head goes first, the body only when told."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def head(self) -> tuple[int, dict[str, str]]:
        """The next response head (an interim ``100`` too)."""
        async with asyncio.timeout(5):
            raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        return int(lines[0].split()[1]), headers

    async def response(self) -> tuple[int, dict[str, str], Any]:
        status, headers = await self.head()
        async with asyncio.timeout(5):
            body = await self.reader.readexactly(int(headers["content-length"]))
        return status, headers, json.loads(body)

    async def nothing_more_answered(self) -> bool:
        """Whether what the client sends now, as a body it held back (a request's bytes), is
        never answered: the connection ends with the response before it (aiohttp reads and
        drops what still comes for a while, as after any ``Connection: close``)."""
        self.writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        try:
            async with asyncio.timeout(0.5):
                return await self.reader.read(65536) == b""  # anything at all: an answer
        except TimeoutError:
            return True
        except ConnectionError:
            return True


@asynccontextmanager
async def exchange(
    address: tuple[str, int], method: str, path: str, headers: dict[str, str], version: str = "1.1"
) -> AsyncIterator[Exchange]:
    reader, writer = await asyncio.open_connection(*address)
    lines = [
        f"{method} {path} HTTP/{version}",
        "Host: t",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    try:
        yield Exchange(reader, writer)
    finally:
        writer.close()


def upload(size: int = UPLOAD, /, **more: str) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Content-Length": str(size),
        "Expect": "100-continue",
        **more,
    }


AUTH = {"Authorization": f"Bearer {KEY}"}
REFUSED = [
    # (what, method, path, headers, status, code)
    ("no key", "POST", "/v1/chat/completions", upload(), 401, "invalid_api_key"),
    ("a wrong key", "POST", "/v1/replies", upload(Authorization="Bearer no"), 401, None),
    ("over the limit", "POST", "/v1/chat/completions", upload(**AUTH), 413, "body_too_large"),
    (
        "a foreign page",
        "POST",
        "/v1/replies",
        upload(Origin="https://elsewhere.example", **AUTH),
        403,
        "cors_forbidden",
    ),
    ("no such route", "POST", "/v1/nothing", upload(100, **AUTH), 404, "not_found"),
    ("no such method", "PUT", "/v1/replies", upload(100, **AUTH), 405, "method_not_allowed"),
    (
        "an unknown expectation",
        "POST",
        "/v1/chat/completions",
        {**upload(100, **AUTH), "Expect": "100-continue, x-fast"},
        417,
        "expectation_failed",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
async def test_a_refused_upload_is_answered_before_its_body_and_its_connection_closed(
    method: str, path: str, headers: dict[str, str], status: int, code: str | None
):
    async with server() as address, exchange(address, method, path, headers) as client:
        got, answer_headers, body = await client.response()  # not a 100 first
        assert got == status, body
        assert body["error"]["message"]
        if code is not None:
            assert body["error"]["code"] == code
        assert answer_headers["x-request-id"]
        assert answer_headers["connection"] == "close"
        assert await client.nothing_more_answered()


@pytest.mark.parametrize("expect", ["x-fast", "100-continue, x-fast"])
async def test_an_unknown_expectation_is_a_417_in_anthropic_shape_on_messages(expect: str):
    headers = {**upload(100), "x-api-key": KEY, "anthropic-version": "2023-06-01"}
    headers["Expect"] = expect
    async with (
        server() as address,
        exchange(address, "POST", "/v1/messages", headers) as client,
    ):
        status, answer_headers, body = await client.response()
        assert status == 417
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert body["request_id"] == answer_headers["x-request-id"]
        assert await client.nothing_more_answered()


async def test_an_upload_that_passes_the_checks_is_invited_then_served_and_kept_alive():
    body = json.dumps({"prompt": "x", "max_tokens": 2, "stream": False}).encode()
    async with (
        server() as address,
        exchange(address, "POST", "/v1/replies", upload(len(body), **AUTH)) as client,
    ):
        status, _ = await client.head()
        assert status == 100
        client.writer.write(body)
        status, _, answer = await client.response()
        assert status == 200 and answer["finish_reason"] == "length"
        # The connection is in step: a second request on it is answered.
        client.writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, health = await client.response()
        assert (status, health["status"]) == (200, "ok")


async def test_http_1_0_gets_no_100_continue_and_is_served_once_its_body_comes():
    body = json.dumps({"prompt": "x", "max_tokens": 2, "stream": False}).encode()
    headers = upload(len(body), **AUTH)
    async with (
        server() as address,
        exchange(address, "POST", "/v1/replies", headers, version="1.0") as client,
    ):
        with pytest.raises(TimeoutError):  # RFC 9110 10.1.1: ignored in HTTP/1.0
            async with asyncio.timeout(0.3):
                await client.reader.readuntil(b"\r\n\r\n")
        client.writer.write(body)
        status, _, answer = await client.response()
        assert status == 200 and answer["finish_reason"] == "length"
