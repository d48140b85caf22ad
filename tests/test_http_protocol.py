"""HTTP/1.1 correctness on a kept-alive connection: no body where none may be, refusals in
our error shape that close the connection, a header deadline for every request.

Each test talks raw HTTP over a loopback socket (or through a real nginx), so a stray body
byte shows up as the next response's broken status line, as it would for a real client.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from replystream.server import create_app, running
from replystream.server.context import ENGINE_KEY
from replystream.server.front_door import unrouted
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.nginx import deploy_config, running_nginx
from tests.services import free_port

MARKER = "EVIL-bytes-7f3a"  # sent inside bad requests; must never come back


class Connection:
    """One kept-alive client connection that reads each response exactly by its framing."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, *, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        """The next response: status, headers, body (none for a HEAD)."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, status = lines[0].split()[:2]
        assert version in ("HTTP/1.1", "HTTP/1.0"), f"not a status line: {lines[0]!r}"
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        if head_only:
            return int(status), headers, b""
        if headers.get("transfer-encoding") == "chunked":
            body = bytearray()
            while size := int((await self.reader.readuntil(b"\r\n"))[:-2], 16):
                body += (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readuntil(b"\r\n")
            return int(status), headers, bytes(body)
        length = int(headers.get("content-length", "0"))
        return int(status), headers, await self.reader.readexactly(length)

    async def request(
        self, method: str, target: str, body: bytes = b"", *, head_only: bool = False
    ) -> tuple[int, dict[str, str], bytes]:
        lines = [f"{method} {target} HTTP/1.1", "Host: test"]
        if body:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        await self.send(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        return await self.response(head_only=head_only)

    async def closed_by_server(self) -> bool:
        """Whether the server closes the connection (within a generous bound)."""
        async with asyncio.timeout(10):
            return await self.reader.read() == b""

    def close(self) -> None:
        self.writer.close()


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[Connection]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    connection = Connection(reader, writer)
    try:
        yield connection
    finally:
        connection.close()


def route_targets(app: web.Application, reply_id: str, model: str) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, path parameters filled with real values (not
    the route answering what no other serves: ``front_door.unrouted``)."""
    values = {"reply_id": reply_id, "model": model, "response_id": "resp_" + reply_id}
    targets = []
    for resource in app.router.resources():
        if any(route.handler is unrouted for route in resource):
            continue
        info = resource.get_info()
        path = info.get("path") or info["formatter"].format(**values)
        for route in resource:
            targets.append((route.method, path))
    return targets


async def test_head_never_sends_a_body_or_starts_a_generation_on_any_route():
    engine = fast_engine(delay_ms=1.0, jitter_ms=0.0)
    app = create_app(engine)
    async with running(app) as url, connect(url) as client:
        status, headers, _ = await client.request(
            "POST", "/v1/replies", b'{"prompt": "x", "max_tokens": 3}'
        )
        assert status == 200
        reply_id = headers["x-reply-id"]
        started = engine.stats().started
        targets = route_targets(app, reply_id, app[ENGINE_KEY].name)
        paths = sorted({path for _, path in targets})
        assert {"/stream", "/wait", f"/v1/replies/{reply_id}/stream", "/v1/ws"} <= set(paths)
        for path in paths:
            status, headers, _ = await client.request("HEAD", path, head_only=True)
            assert status in (200, 405), (path, status)
            if status == 405:
                assert "HEAD" not in headers["allow"].split(","), path
            else:
                assert headers.get("transfer-encoding") != "chunked", path
                assert "text/event-stream" not in headers.get("content-type", ""), path
            # The connection is still in step: the next response is read as a response.
            status, _, body = await client.request("GET", "/healthz")
            assert (status, json.loads(body)["status"]) == (200, "ok"), f"after HEAD {path}"
        assert engine.stats().started == started, "a HEAD started a generation"


async def test_a_method_a_route_does_not_serve_is_a_405_in_the_error_shape():
    app = create_app(fast_engine())
    async with running(app) as url, connect(url) as client:
        targets = route_targets(app, "r" * 32, app[ENGINE_KEY].name)
        for path in sorted({path for _, path in targets}):
            served = {method for method, p in targets if p == path}
            for method in sorted({"PUT", "DELETE", "PATCH", "OPTIONS", "GET", "POST"} - served):
                status, headers, body = await client.request(method, path)
                assert status == 405, (method, path)
                assert set(headers["allow"].split(",")) == served | (
                    {"HEAD"} if "HEAD" in served else set()
                )
                assert json.loads(body)["error"]["code"] == "method_not_allowed"


async def test_a_404_names_the_path_as_it_was_matched_an_encoded_slash_kept():
    # /v1/chat%2Fcompletions is not /v1/chat/completions (the router keeps %2F as it came):
    # its 404 must not name the route that does exist.
    async with running(create_app(fast_engine())) as url, connect(url) as client:
        status, _, body = await client.request("POST", "/v1/chat%2Fcompletions", b"{}")
        assert status == 404
        message = json.loads(body)["error"]["message"]
        assert message == "Not Found: POST /v1/chat%2Fcompletions is not a route of this server"
        status, _, body = await client.request("GET", "/v1/%63hat/completions")
        assert status == 405  # an encoded letter is the letter: the route, asked with GET
        message = json.loads(body)["error"]["message"]
        assert message.startswith("Method Not Allowed: /v1/chat/completions takes POST")


async def test_no_route_invites_a_body_before_the_front_door_refused_its_request():
    # A foreign page's request is refused on every route: with ``Expect: 100-continue`` the
    # refusal comes first, never a ``100 Continue`` (every route leaves ``Expect`` to the
    # front door: a route added with aiohttp's default expect handler fails here).
    app = create_app(fast_engine())
    async with running(app) as url:
        targets = route_targets(app, "r" * 32, app[ENGINE_KEY].name)
        extra = [("POST", "/no/such/route"), ("POST", "/line%0Abreak"), ("PATCH", "/healthz")]
        for method, path in [*targets, *extra]:
            async with connect(url) as client:
                head = (
                    f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n"
                    "Expect: 100-continue\r\nOrigin: https://elsewhere.example\r\n\r\n"
                )
                await client.send(head.encode())
                status, headers, _ = await client.response(head_only=True)
                assert status == 403, (method, path, status)
                assert headers["connection"] == "close", (method, path)


async def test_head_through_nginx_leaves_the_pooled_upstream_connection_in_step(tmp_path):
    engine = fast_engine(delay_ms=2.0, jitter_ms=0.0)
    port = free_port()
    async with running(create_app(engine)) as app_url:
        config = deploy_config(app_url, port)
        async with running_nginx(config, port, tmp_path) as proxy:
            for _ in range(3):
                async with connect(proxy) as client:
                    status, _, _ = await client.request(
                        "HEAD", "/stream?max_tokens=5", head_only=True
                    )
                    assert status == 405
            # Requests from other clients reuse nginx's pooled connections to the app.
            async with asyncio.timeout(10):
                for _ in range(6):
                    async with connect(proxy) as client:
                        status, _, body = await client.request("GET", "/healthz")
                        assert status == 200 and json.loads(body)["status"] == "ok"
                        status, _, body = await client.request("GET", "/wait?max_tokens=2")
                        assert status == 200 and json.loads(body)["text"]
    assert engine.stats().started == 6


# Each request the HTTP parser refuses, and the status and code it is answered with.
BAD_REQUESTS = {
    "content-length with transfer-encoding": (
        "POST /v1/replies HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
        f"Transfer-Encoding: chunked\r\nX-Note: {MARKER}\r\n\r\n0\r\n\r\n",
        400,
        "bad_body_framing",
    ),
    "transfer-encoding with content-length": (
        "POST /v1/replies HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        f"Content-Length: 5\r\nX-Note: {MARKER}\r\n\r\n0\r\n\r\n",
        400,
        "bad_body_framing",
    ),
    "duplicate content-length": (
        "POST /v1/replies HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n"
        f"X-Note: {MARKER}\r\n\r\n{{}}",
        400,
        "bad_body_framing",
    ),
    "bad content-length": (
        f"POST /v1/replies HTTP/1.1\r\nHost: t\r\nContent-Length: 1{MARKER}\r\n\r\n{{}}",
        400,
        "bad_body_framing",
    ),
    "unknown transfer-encoding": (
        f"POST /v1/replies HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: {MARKER}\r\n\r\n",
        400,
        "bad_body_framing",
    ),
    "header field too long": (
        f"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: {MARKER * 900}\r\n\r\n",
        431,
        "header_too_large",
    ),
    "url too long": (
        f"GET /healthz?q={MARKER * 900} HTTP/1.1\r\nHost: t\r\n\r\n",
        414,
        "uri_too_long",
    ),
    "header field too long after a long url": (
        f"GET /healthz?q={MARKER * 30} HTTP/1.1\r\nHost: t\r\nX-Big: {MARKER * 900}\r\n\r\n",
        431,
        "header_too_large",
    ),
    "too many header fields": (
        "GET /healthz HTTP/1.1\r\nHost: t\r\n"
        + "".join(f"X-{n}: {MARKER}\r\n" for n in range(200))
        + "\r\n",
        431,
        "header_too_large",
    ),
    "too many trailer fields": (
        "POST /v1/replies HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        "2\r\n{}\r\n0\r\n" + "".join(f"X-{n}: {MARKER}\r\n" for n in range(200)) + "\r\n",
        431,
        "header_too_large",
    ),
    "bad method": (f"G{MARKER}(T /healthz HTTP/1.1\r\nHost: t\r\n\r\n", 400, "bad_method"),
    "space in header name": (
        f"GET /healthz HTTP/1.1\r\nHost: t\r\nX {MARKER}: 1\r\n\r\n",
        400,
        "bad_header",
    ),
    "control byte in header": (
        f"GET /healthz HTTP/1.1\r\nHost: t\r\nX-A: {MARKER}\x01\r\n\r\n",
        400,
        "bad_header",
    ),
    "not http at all": (f"\x16\x03\x01{MARKER}\r\n\r\n", 400, "bad_method"),
    "bad version": (
        f"GET /healthz HTTP/9.{MARKER}\r\nHost: t\r\n\r\n",
        400,
        "malformed_request",
    ),
    "http/2.0 in text": (
        f"GET /healthz HTTP/2.0\r\nHost: t\r\nX-Note: {MARKER}\r\n\r\n",
        400,
        "malformed_request",
    ),
    "http/0.9 request line": (f"GET /healthz?{MARKER}\r\n\r\n", 400, "malformed_request"),
    "brotli body": (
        "POST /v1/replies HTTP/1.1\r\nHost: t\r\nContent-Encoding: br\r\n"
        f"Content-Length: 20\r\n\r\n{MARKER[:15]}12345",
        415,
        "unsupported_content_encoding",
    ),
    "bad chunk size": (
        "POST /v1/replies HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        f"{MARKER}\r\n{{}}\r\n0\r\n\r\n",
        400,
        "bad_body_framing",
    ),
    "chunk longer than its size": (
        "POST /v1/replies HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        f"2\r\n{{}}{MARKER}\r\n0\r\n\r\n",
        400,
        "bad_body_framing",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_parser_refusals_use_the_error_shape_echo_nothing_and_close(case, caplog):
    caplog.set_level(logging.DEBUG)
    request, expected_status, expected_code = BAD_REQUESTS[case]
    async with running(create_app(fast_engine())) as url, connect(url) as client:
        # One good request first: the refusal must also hold on a kept-alive connection.
        status, _, _ = await client.request("GET", "/healthz")
        assert status == 200
        await client.send(request.encode("latin-1"))
        status, headers, body = await client.response()
        assert headers["content-type"].startswith("application/json")
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (status, error["code"]) == (expected_status, expected_code)
        assert error["type"] == "invalid_request_error"
        assert MARKER not in body.decode("latin-1") and MARKER not in str(headers)
        assert await client.closed_by_server()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    # Each request answered has its access-log line, the refused one too (echoing nothing).
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"]
    assert [line["status"] for line in lines] == [200, expected_status]
    assert lines[1]["refused"] == expected_code and lines[1]["path"] is None
    assert MARKER not in str(lines)


def on_route(request: str, path: str) -> str:
    """``request`` sent to ``path`` instead (its own path, whatever it was, replaced)."""
    return request.replace("/v1/replies", path).replace("/healthz", path)


def assert_anthropic_refusal(body: bytes, code: str) -> None:
    answer = json.loads(body)
    # The request's id too once it has one (a refusal of its head comes before that).
    assert answer["type"] == "error" and set(answer) - {"request_id"} == {"type", "error"}
    assert set(answer["error"]) == {"type", "message", "code", "param"}
    assert (answer["error"]["type"], answer["error"]["code"]) == ("invalid_request_error", code)


ROUTED = sorted(
    case for case, (request, _, _) in BAD_REQUESTS.items() if on_route(request, "/x") != request
)


@pytest.mark.parametrize("case", ROUTED)
async def test_parser_refusals_on_the_anthropic_route_are_in_anthropics_shape(case, caplog):
    caplog.set_level(logging.DEBUG)
    request, expected_status, expected_code = BAD_REQUESTS[case]
    async with running(create_app(fast_engine())) as url, connect(url) as client:
        status, _, _ = await client.request("GET", "/healthz")  # kept alive, then refused
        assert status == 200
        await client.send(on_route(request, "/v1/messages").encode("latin-1"))
        status, headers, body = await client.response()
        assert status == expected_status
        assert headers["content-type"].startswith("application/json")
        assert_anthropic_refusal(body, expected_code)
        assert MARKER not in body.decode("latin-1")
        assert await client.closed_by_server()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_refusal_takes_the_shape_of_the_route_its_own_request_named():
    message = (
        b'{"model": "simulated", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}'
    )
    framing, _, code = BAD_REQUESTS["content-length with transfer-encoding"]
    async with running(create_app(fast_engine(delay_ms=1.0, jitter_ms=0.0))) as url:
        # After a request to the Anthropic route, a refused one to another is in OpenAI's shape.
        async with connect(url) as client:
            status, _, _ = await client.request("POST", "/v1/messages", message)
            assert status == 200
            await client.send(on_route(framing, "/v1/chat/completions").encode())
            status, _, body = await client.response()
            assert (status, json.loads(body)["error"]["code"]) == (400, code)
            assert "type" not in json.loads(body)
        # A head that arrives in pieces is read from its start.
        async with connect(url) as client:
            status, _, _ = await client.request("GET", "/healthz")
            assert status == 200
            refused = on_route(framing, "/v1/messages").encode()
            for piece in (refused[:9], refused[9:30], refused[30:]):
                await client.send(piece)
                await asyncio.sleep(0.05)
            status, _, body = await client.response()
            assert status == 400
            assert_anthropic_refusal(body, code)


CHAT = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}'


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/replies"])
async def test_a_bad_chunk_after_the_head_is_refused_at_once_in_the_routes_shape(path, caplog):
    caplog.set_level(logging.DEBUG)
    config = ServerConfig(guard=GuardConfig(body_timeout_s=3.0))
    async with running(create_app(fast_engine(), config)) as url, connect(url) as client:
        head = f"POST {path} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        await client.send(head.encode())
        await asyncio.sleep(0.2)  # the head is parsed; the handler waits for the body
        loop = asyncio.get_running_loop()
        sent = loop.time()
        # A good chunk (which the waiting handler is woken for), then a bad one, in one read.
        good = b"%x\r\n%s\r\n" % (len(CHAT) - 4, CHAT[:-4])
        await client.send(good + f"{MARKER}\r\n".encode() + CHAT[-4:] + b"\r\n0\r\n\r\n")
        status, headers, body = await client.response()
        assert loop.time() - sent < 1.0  # not after the body timeout
        assert status == 400 and headers["content-type"].startswith("application/json")
        if path == "/v1/messages":
            assert_anthropic_refusal(body, "bad_body_framing")
        else:
            assert json.loads(body)["error"]["code"] == "bad_body_framing"
        assert MARKER not in body.decode("latin-1")
        assert await client.closed_by_server()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_a_bad_chunk_in_a_body_the_handler_does_not_read_ends_the_connection(caplog):
    caplog.set_level(logging.DEBUG)
    async with running(create_app(fast_engine())) as url, connect(url) as client:
        await client.send(
            b"GET /healthz HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n"
        )
        status, _, _ = await client.response()
        assert status == 200
        await client.send(f"{MARKER}\r\nxx\r\n0\r\n\r\n".encode())
        # The broken body is no request of its own: no second response, the connection ends.
        assert await client.closed_by_server()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_the_header_deadline_holds_for_every_request_on_a_kept_alive_connection():
    config = ServerConfig(guard=GuardConfig(header_timeout_s=0.5))
    async with running(create_app(fast_engine(), config)) as url, connect(url) as client:
        for _ in range(2):  # kept alive, and in good standing
            status, _, _ = await client.request("GET", "/healthz")
            assert status == 200
        await client.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        loop = asyncio.get_running_loop()
        started = loop.time()
        closed = False
        for line in range(60):  # a header line every 0.1 s: 6 s if nobody stops it
            try:
                await client.send(b"X-Line-%d: 1\r\n" % line)
            except ConnectionError:
                closed = True
                break
            await asyncio.sleep(0.1)
            if client.reader.at_eof():
                closed = True
                break
        if not closed:
            closed = await client.closed_by_server()
        assert closed
        assert loop.time() - started < 4.0  # the deadline (0.5 s), not the trickle's end


async def test_an_idle_kept_alive_connection_is_not_cut_by_the_header_deadline():
    config = ServerConfig(guard=GuardConfig(header_timeout_s=0.3))
    async with running(create_app(fast_engine(), config)) as url, connect(url) as client:
        status, _, _ = await client.request("GET", "/healthz")
        assert status == 200
        await asyncio.sleep(0.8)  # silent between requests: keep-alive's business
        status, _, _ = await client.request("GET", "/healthz")
        assert status == 200


async def test_a_kept_alive_connection_idle_past_the_idle_timeout_is_closed_but_a_stream_is_not():
    config = ServerConfig(guard=GuardConfig(idle_timeout_s=0.3))
    engine = fast_engine(delay_ms=100.0, jitter_ms=0.0)  # a reply of 8 tokens: about 0.8 s
    async with running(create_app(engine, config)) as url, connect(url) as client:
        body = json.dumps({"prompt": "x", "max_tokens": 8}).encode()
        await client.send(
            b"POST /v1/replies HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        async with asyncio.timeout(10):  # the whole stream, longer than the idle timeout
            streamed = await client.reader.readuntil(b"event: done")
        assert streamed.startswith(b"HTTP/1.1 200")
        await client.reader.readuntil(b"0\r\n\r\n")  # the stream's last chunk: now idle
        loop = asyncio.get_running_loop()
        idle_from = loop.time()
        assert await client.closed_by_server()
        assert loop.time() - idle_from >= 0.25


async def test_a_request_begun_before_the_idle_timeout_has_its_header_deadline_to_arrive():
    """Once the next request's first byte arrived, the connection is no longer idle: its
    headers have --header-timeout-s from that byte, not what was left of the idle time."""
    config = ServerConfig(guard=GuardConfig(idle_timeout_s=1.0, header_timeout_s=2.0))
    async with running(create_app(fast_engine(), config)) as url, connect(url) as client:
        status, _, _ = await client.request("GET", "/healthz")
        assert status == 200
        await asyncio.sleep(0.7)  # silent, within the idle timeout
        await client.send(b"GET /healthz HTTP/1.1\r\n")
        await asyncio.sleep(0.8)  # past the idle timeout, within the header deadline
        await client.send(b"Host: t\r\n\r\n")
        async with asyncio.timeout(5):
            status, _, _ = await client.response()
        assert status == 200


async def test_an_http_1_0_stream_asked_to_keep_alive_ends_with_its_connection():
    """HTTP/1.0 has no chunked framing: an event stream's body ends only where its connection
    does. Were the connection kept alive, the client could not tell where the stream ended,
    and the answer to a request sent after it would be read as more of the stream."""
    async with running(create_app(fast_engine(delay_ms=1.0, jitter_ms=0.0))) as url:
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
        native = {"prompt": "x", "max_tokens": 2}
        for path, request in (("/v1/replies", native), ("/v1/chat/completions", chat)):
            body = json.dumps(request).encode()
            async with connect(url) as client:
                await client.send(
                    f"POST {path} HTTP/1.0\r\nConnection: keep-alive\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                    + b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
                )
                async with asyncio.timeout(10):
                    received = await client.reader.read()  # all of it: the server closes
            head, _, stream = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200"), path
            assert b"keep-alive" not in head.lower(), path
            assert b"content-length" not in head.lower(), path
            assert b"HTTP/1.0" not in stream, path  # no second response inside the stream


@pytest.mark.parametrize("path", ["/healthz", "/v1/replies"])
async def test_a_request_pipelined_after_an_h2c_upgrade_is_not_lost(path):
    """curl --http2 on http:// asks to upgrade to h2c; a request sent right after it on the
    same connection is answered, or the connection ends to say it was not: never silence."""
    body = b'{"prompt": "x", "max_tokens": 2}' if path == "/v1/replies" else b""
    method = "POST" if body else "GET"
    async with running(create_app(fast_engine(delay_ms=1.0, jitter_ms=0.0))) as url:
        async with connect(url) as client:
            await client.send(
                f"{method} {path} HTTP/1.1\r\nHost: t\r\n"
                "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                f"HTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
                + b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
            )
            async with asyncio.timeout(10):
                status, _, _ = await client.response()
                assert status == 200
                rest = await client.reader.read()  # to the end: the server closes
            # The models list, or nothing: closed, so the client sends it again.
            assert rest == b"" or (rest.startswith(b"HTTP/1.1 200") and b'"list"' in rest)


@pytest.mark.parametrize("codings", ["gzip, chunked", "deflate,chunked"])
async def test_a_transfer_coding_other_than_chunked_is_refused_not_read_as_the_body(codings):
    body = gzip.compress(b'{"prompt": "x", "max_tokens": 2}')
    async with running(create_app(fast_engine(delay_ms=1.0, jitter_ms=0.0))) as url:
        async with connect(url) as client:
            await client.send(
                f"POST /v1/replies HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: {codings}\r\n"
                f"Content-Type: application/json\r\n\r\n{len(body):x}\r\n".encode()
                + body
                + b"\r\n0\r\n\r\n"
            )
            status, headers, answer = await client.response()
            assert (status, json.loads(answer)["error"]["code"]) == (400, "bad_body_framing")
            assert headers.get("connection") == "close"
            assert await client.closed_by_server()
