"""Abusive clients get limits, not crashes: rates, concurrency, slow requests, CORS, ids."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from urllib.parse import urlsplit

import aiohttp
import pytest

from replystream import cli
from replystream.engine.base import EngineStats, GenerationRequest, InProcessEngine
from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, serve_engine, wait_for
from tests.rawhttp import RawResponse, raw_request


def serve_with(guard: GuardConfig, **config: object):
    return running(create_app(fast_engine(), ServerConfig(guard=guard, **config)))  # type: ignore[arg-type]


async def test_requests_over_the_rate_get_429_with_retry_after():
    async with serve_with(GuardConfig(per_minute=3)) as url:
        statuses = []
        for _ in range(4):
            response = await raw_request(f"{url}/wait?max_tokens=1")
            body = await response.read_body()
            statuses.append(response.status)
        assert statuses == [200, 200, 200, 429]
        assert int(response.headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "rate_limited"
        health = await raw_request(f"{url}/healthz")  # not limited: operators must see in
        assert health.status == 200
        await health.read_body()


async def test_open_requests_per_client_are_capped_and_freed_when_they_end():
    async with serve_with(GuardConfig(max_concurrent=2)) as url:
        first = await raw_request(f"{url}/stream")
        second = await raw_request(f"{url}/stream")
        third = await raw_request(f"{url}/stream")
        assert (first.status, second.status, third.status) == (200, 200, 429)
        await third.read_body()
        await first.read_body()  # the first stream ends: its slot is free again
        fourth = await raw_request(f"{url}/stream?max_tokens=2")
        assert fourth.status == 200
        await fourth.read_body()
        await second.aclose()


async def test_limits_count_per_api_key_not_per_address():
    config = {"api_keys": ("key-a", "key-b")}
    async with serve_with(GuardConfig(per_minute=1), **config) as url:

        async def status(key: str) -> int:
            response = await raw_request(
                f"{url}/v1/replies",
                "POST",
                b'{"prompt": "x", "max_tokens": 1, "stream": false}',
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
            await response.read_body()
            return response.status

        assert [await status("key-a"), await status("key-b")] == [200, 200]
        assert await status("key-a") == 429


async def test_background_responses_are_open_requests_of_their_key_until_they_end():
    # A background response runs on after its answer: were it not counted, a key held to 2
    # requests at once could run any number of generations of up to 2^20 tokens each.
    # (The second is streamed, and its reader leaves at once: it goes on all the same.)
    engine = fast_engine(delay_ms=50.0, jitter_ms=0.0)
    config = ServerConfig(guard=GuardConfig(max_concurrent=2), api_keys=("key-a",))
    auth = {"Authorization": "Bearer key-a", "Content-Type": "application/json"}
    job = {"input": "x", "background": True, "max_output_tokens": 100_000}
    async with running(create_app(engine, config)) as url, aiohttp.ClientSession() as http:

        async def create(body: dict[str, object]) -> tuple[int, dict[str, object]]:
            async with http.post(f"{url}/v1/responses", json=body, headers=auth) as response:
                return response.status, await response.json()

        first = await create(job)
        async with http.post(
            f"{url}/v1/responses", json={**job, "stream": True}, headers=auth
        ) as streamed:
            assert streamed.status == 200
            second_id = streamed.headers["X-Reply-Id"]
        assert first[0] == 200
        status, refused = await create(job)
        assert status == 429 and refused["error"]["code"] == "rate_limited"  # type: ignore[index]
        assert engine.stats().started == 2
        # polling and cancelling them need no room of their own
        async with http.get(f"{url}/v1/responses/resp_{second_id}", headers=auth) as r:
            assert r.status == 200
        async with http.post(f"{url}/v1/responses/{first[1]['id']}/cancel", headers=auth) as r:
            assert r.status == 200
        # its end frees its place: the next one is taken
        async with asyncio.timeout(5):
            while (again := await create({**job, "max_output_tokens": 1}))[0] == 429:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        assert again[0] == 200


async def test_a_connection_that_never_finishes_its_headers_is_closed():
    app = create_app(fast_engine(), ServerConfig(guard=GuardConfig(header_timeout_s=0.3)))
    async with running(app) as url:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and then nothing
        await writer.drain()
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the server
        writer.close()


async def test_the_header_timeout_closes_silent_connections_not_long_streams():
    # Three connections accepted together: one stays silent, two send a request whose reply
    # streams for about a second, well past the 0.3 s header timeout.
    engine = fast_engine(delay_ms=50.0, jitter_ms=0.0)
    app = create_app(engine, ServerConfig(guard=GuardConfig(header_timeout_s=0.3)))
    async with running(app) as url:
        parts = urlsplit(url)
        silent_reader, silent_writer = await asyncio.open_connection(parts.hostname, parts.port)
        body = b'{"prompt": "x", "max_tokens": 20}'
        replies = [
            raw_request(f"{url}/v1/replies", "POST", body, headers={"X-Request-Id": f"r{i}"})
            for i in range(2)
        ]
        responses = await asyncio.gather(*replies)
        bodies = await asyncio.gather(*(response.read_body() for response in responses))
        async with asyncio.timeout(5):
            assert await silent_reader.read() == b""  # the silent one was closed
        silent_writer.close()
    assert [response.status for response in responses] == [200, 200]
    for streamed in bodies:
        assert streamed.count(b"event: token") == 20 and b"event: done" in streamed


async def test_a_body_that_does_not_arrive_is_a_408_that_closes_its_connection():
    app = create_app(fast_engine(), ServerConfig(guard=GuardConfig(body_timeout_s=0.3)))
    async with running(app) as url:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(
            b"POST /v1/replies HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 30\r\n\r\n{"prompt":'
        )
        await writer.drain()
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(int(head.split(b"Content-Length: ")[1].split()[0]))
        # A client that takes the 408 for a finished exchange sends its next request: not
        # read as the rest of the old body.
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(5):
            rest = await reader.read()  # all of it: the server closes
        writer.close()
    assert head.startswith(b"HTTP/1.1 408")
    assert b'"code": "body_timeout"' in body
    assert b"Connection: close" in head
    assert rest == b""  # no answer made of the next request's leftover bytes


async def test_a_body_declared_past_the_limit_is_a_413_before_it_is_sent():
    config = ServerConfig(max_body_bytes=2000, guard=GuardConfig(body_timeout_s=60))
    async with running(create_app(fast_engine(), config)) as url:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2001\r\n\r\n{"
        )
        await writer.drain()
        async with asyncio.timeout(10):  # far below the body timeout: answered on the header
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(int(head.split(b"Content-Length: ")[1].split()[0]))
        writer.close()
    assert head.startswith(b"HTTP/1.1 413")
    assert b"Connection: close" in head  # the unread body ends the connection
    assert json.loads(body)["error"]["code"] == "body_too_large"


async def test_oversized_headers_are_refused_and_errors_never_show_a_traceback():
    class Broken(InProcessEngine):
        name = "broken"
        pushes = False
        queues = False
        makes_tool_calls = False

        async def start(self, request: GenerationRequest):
            raise RuntimeError("secret internals")

        def seed_for(self, request: GenerationRequest) -> int | None:
            return request.sampling.seed

        def count_tokens(self, text: str) -> int:
            return 0

        def count_prompt(self, request: GenerationRequest) -> int:
            return 0

        def stats(self) -> EngineStats:
            return EngineStats(started=0, finished=0, cancelled=0, failed=0, active=0, steps=0)

        async def aclose(self) -> None:
            pass

    async with running(create_app(Broken(), ServerConfig(max_header_bytes=1024))) as url:
        big = await raw_request(f"{url}/healthz", headers={"X-Big": "x" * 4000})
        assert big.status in (400, 431)
        await big.read_body()
        failed = await raw_request(f"{url}/wait")
        body = await failed.read_body()
    assert failed.status == 500
    assert json.loads(body)["error"]["code"] == "internal_error"
    assert b"Traceback" not in body and b"secret internals" not in body


async def test_cors_allows_listed_origins_only_including_on_event_streams():
    async with serve_with(GuardConfig(cors_origins=("https://chat.example",))) as url:
        allowed = await raw_request(
            f"{url}/stream?max_tokens=2", headers={"Origin": "https://chat.example"}
        )
        await allowed.read_body()
        other = await raw_request(
            f"{url}/stream?max_tokens=2", headers={"Origin": "https://evil.example"}
        )
        await other.read_body()
        preflight = await raw_request(
            f"{url}/v1/replies",
            "OPTIONS",
            headers={"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"},
        )
        await preflight.read_body()
        refused = await raw_request(
            f"{url}/v1/replies",
            "OPTIONS",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        await refused.read_body()
    assert allowed.headers["access-control-allow-origin"] == "https://chat.example"
    assert "x-reply-id" in allowed.headers["access-control-expose-headers"].lower()
    assert "access-control-allow-origin" not in other.headers
    assert preflight.status == 204
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert refused.status == 403


@pytest.mark.parametrize(
    ("given", "page"),
    [
        ("http://[0:0:0:0:0:0:0:1]:3000", "http://[::1]:3000"),
        ("http://[::FFFF:127.0.0.1]:3000", "http://[::ffff:7f00:1]:3000"),
        ("https://[2001:DB8:0:0:1:0:0:1]:443", "https://[2001:db8::1:0:0:1]"),
    ],
)
async def test_an_ipv6_origin_on_the_command_line_matches_the_page_a_browser_names(
    given: str, page: str
):
    # A browser writes an IPv6 origin in one form (the URL Standard's): the allow-list
    # holds that form however the address was spelt on the command line.
    args = cli.parse(["serve", "--cors-origin", given])
    async with serve_with(GuardConfig(cors_origins=tuple(args.cors_origin))) as url:
        allowed = await raw_request(f"{url}/stream?max_tokens=2", headers={"Origin": page})
        await allowed.read_body()
    assert allowed.headers.get("access-control-allow-origin") == page, allowed.headers


async def test_a_preflight_allows_the_sdks_headers_and_delete_to_a_listed_origin():
    # The official SDKs send headers of their own, which a browser asks leave for first
    # (OpenAI's x-stainless-*, Anthropic's x-api-key and anthropic-version); a stored
    # response is deleted with DELETE.
    asked = "authorization, x-stainless-os, x-api-key, anthropic-version, content-type"
    async with serve_with(GuardConfig(cors_origins=("https://chat.example",))) as url:
        preflight = await raw_request(
            f"{url}/v1/responses/resp_x",
            "OPTIONS",
            headers={
                "Origin": "https://chat.example",
                "Access-Control-Request-Method": "DELETE",
                "Access-Control-Request-Headers": asked,
            },
        )
        await preflight.read_body()
    assert preflight.status == 204
    assert "DELETE" in preflight.headers["access-control-allow-methods"]
    allowed = {
        h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")
    }
    assert allowed >= {h.strip() for h in asked.split(",")} | {"last-event-id", "x-request-id"}


async def test_a_request_from_a_foreign_page_is_refused_websocket_or_not():
    # A browser applies no CORS to a WebSocket: a page of any site could open one and read
    # every reply; and a "simple" POST (text/plain, no preflight) is sent whatever CORS says,
    # only its answer hidden. Pages of this server's own host and listed origins may call
    # it; others get a 403 and no reply is made.
    async def opens(url: str, origin: str | None) -> int | str:
        headers = {} if origin is None else {"Origin": origin}
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(f"{url}/v1/ws", headers=headers) as ws:
                    await ws.send_json({"type": "reply", "id": "a", "prompt": "x", "max_tokens": 1})
                    while (message := await ws.receive_json())["type"] not in ("done", "error"):
                        pass
                    return str(message["type"])
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    async with serve_with(GuardConfig(cors_origins=("https://chat.example",))) as url:
        port = urlsplit(url).port
        assert await opens(url, "https://evil.example") == 403
        assert await opens(url, "null") == 403
        assert await opens(url, f"http://evil.example:{port}") == 403
        assert await opens(url, None) == "done"  # not a browser
        assert await opens(url, "https://chat.example") == "done"
        assert await opens(url, f"http://127.0.0.1:{port}") == "done"  # the server's own page
        assert await opens(url, "http://127.0.0.1:8443") == "done"  # behind a proxy's port
        async with aiohttp.ClientSession() as http:
            simple = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
            body = '{"prompt": "x", "max_tokens": 1, "stream": false}'
            async with http.post(f"{url}/v1/replies", data=body, headers=simple) as response:
                assert response.status == 403
                assert (await response.json())["error"]["code"] == "cors_forbidden"
            anthropic = {**simple, "anthropic-version": "2023-06-01"}
            async with http.post(f"{url}/v1/messages", data="{}", headers=anthropic) as response:
                assert response.status == 403  # in the shape the route's clients read
                assert (await response.json())["error"]["type"] == "permission_error"
            mine = {**simple, "Origin": "https://chat.example"}
            async with http.post(f"{url}/v1/replies", data=body, headers=mine) as response:
                assert response.status == 200
    async with serve_with(GuardConfig(cors_origins=("*",))) as url:
        assert await opens(url, "https://evil.example") == "done"


async def test_every_response_has_a_request_id_that_the_access_log_names(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with serve_with(GuardConfig()) as url:
        mine = await raw_request(f"{url}/stream?max_tokens=2", headers={"X-Request-Id": "abc-123"})
        await mine.read_body()
        fresh = await raw_request(f"{url}/nowhere")
        await fresh.read_body()
        # A reply answered whole is named too (its line once said null): chat's, and a
        # stored response's.
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        answered_whole: dict[str, str] = {}
        for request_id, path, body in (
            ("whole-1", "/v1/chat/completions", chat),
            ("stored-1", "/v1/responses", {"input": "x", "max_output_tokens": 2}),
        ):
            whole = await raw_request(
                f"{url}{path}",
                "POST",
                json.dumps(body).encode(),
                headers={"X-Request-Id": request_id, "Content-Type": "application/json"},
            )
            await whole.read_body()
            answered_whole[request_id] = whole.headers["x-reply-id"]
        # A request that names a reply, to cancel, read or delete it, is named by it too.
        kept = await raw_request(
            f"{url}/v1/replies",
            "POST",
            json.dumps({"prompt": "x", "max_tokens": 2, "resumable": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        await kept.read_body()
        reply_id = kept.headers["x-reply-id"]
        stored = answered_whole["stored-1"]
        response_id = f"resp_{stored}"  # the Responses API's id of the reply
        for request_id, method, path in (
            ("cancel-1", "POST", f"/v1/replies/{reply_id}/cancel"),
            ("read-1", "GET", f"/v1/responses/{response_id}"),
            ("items-1", "GET", f"/v1/responses/{response_id}/input_items"),
            ("delete-1", "DELETE", f"/v1/responses/{response_id}"),
        ):
            named = await raw_request(f"{url}{path}", method, headers={"X-Request-Id": request_id})
            await named.read_body()
            assert named.status == 200, (path, named.status)
            answered_whole[request_id] = reply_id if "replies" in path else stored
        await asyncio.sleep(0.05)
    assert mine.headers["x-request-id"] == "abc-123"
    made = fresh.headers["x-request-id"]
    assert str(uuid.UUID(made)) == made and uuid.UUID(made).version == 4
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"]
    by_id = {line["request_id"]: line for line in lines}
    assert (
        by_id["abc-123"]["status"] == 200
        and by_id["abc-123"]["reply_id"] == mine.headers["x-reply-id"]
    )
    assert by_id[fresh.headers["x-request-id"]]["status"] == 404
    for request_id, reply_id in answered_whole.items():
        assert by_id[request_id]["reply_id"] == reply_id, request_id


async def raw_head(url: str, request: bytes) -> list[str]:
    """The header lines of the response to ``request`` (repeated names kept apart)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(request)
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    return head.decode("latin-1").split("\r\n")[1:]


def header_values(lines: list[str], name: str) -> list[str]:
    found = (line.partition(":") for line in lines)
    return [
        value.strip()
        for key, _, value in found
        if key.strip().lower() == name
        for value in value.split(",")
    ]


async def test_a_gzipped_answer_to_an_allowed_origin_varies_on_both():
    """A cache must keep gzip's form from clients that do not take it, whatever the origin."""
    guard = GuardConfig(cors_origins=("https://chat.example",))
    async with serve_with(guard, gzip_min_bytes=1) as url:
        lines = await raw_head(
            url,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n"
            b"Origin: https://chat.example\r\nConnection: close\r\n\r\n",
        )
    assert header_values(lines, "content-encoding") == ["gzip"]
    assert sorted(header_values(lines, "vary")) == ["Accept-Encoding", "Origin"]


async def test_a_preflight_allows_the_headers_and_methods_the_api_takes_from_a_browser():
    """Anthropic's SDK sends its key as x-api-key, with anthropic-version; both SDKs add their
    x-stainless-* headers; DELETE /v1/responses/{id} is a route. A browser sends none of
    them unless the preflight names them."""
    asked = "content-type, x-api-key, anthropic-version, x-stainless-retry-count"
    async with serve_with(GuardConfig(cors_origins=("https://chat.example",))) as url:
        lines = await raw_head(
            url,
            b"OPTIONS /v1/responses/resp_x HTTP/1.1\r\nHost: x\r\n"
            b"Origin: https://chat.example\r\nAccess-Control-Request-Method: DELETE\r\n"
            + f"Access-Control-Request-Headers: {asked}\r\n".encode()
            + b"Connection: close\r\n\r\n",
        )
    allowed = {value.lower() for value in header_values(lines, "access-control-allow-headers")}
    assert set(asked.split(", ")) <= allowed
    assert {"authorization", "last-event-id", "x-request-id"} <= allowed
    assert "DELETE" in header_values(lines, "access-control-allow-methods")
    vary = {value.lower() for value in header_values(lines, "vary")}
    assert {"origin", "access-control-request-headers"} <= vary


async def test_replies_left_to_run_detached_hold_their_clients_room_until_a_reader_returns():
    # A resumable reply its client leaves generates on for the detach grace: were it not
    # counted, a client held to one request at once could leave any number generating.
    # The second one left finds the client's room taken by the first: it stops.
    engine = fast_engine(delay_ms=20.0, jitter_ms=0.0)
    config = ServerConfig(guard=GuardConfig(max_concurrent=1))
    body = b'{"prompt": "x", "resumable": true, "max_tokens": 400}'
    async with running(create_app(engine, config)) as url:

        async def admitted(path: str, method: str = "GET", data: bytes = b"") -> RawResponse:
            while (response := await raw_request(f"{url}{path}", method, data)).status == 429:
                await response.read_body()  # until the server has seen the last request go
                await asyncio.sleep(0.02)
            return response

        async def leave_one() -> str:
            started = await admitted("/v1/replies", "POST", body)
            await started.aclose()
            return started.headers["x-reply-id"]

        first, second = await leave_one(), await leave_one()
        await (await admitted("/wait?max_tokens=1")).read_body()
        stopped = await (await admitted(f"/v1/replies/{second}/stream")).read_body()
        assert b"reply stopped: detach_refused" in stopped.rstrip().rsplit(b"\n\n", 1)[-1]
        resumed = await admitted(f"/v1/replies/{first}/stream")
        assert resumed.status == 200
        assert b"event: done" in (await resumed.read_body()).rstrip().rsplit(b"\n\n", 1)[-1]
        # read to its end, the first freed its room: the next one left goes on
        third = await leave_one()
        await (await admitted("/wait?max_tokens=1")).read_body()
        resumed = await admitted(f"/v1/replies/{third}/stream")
        assert b"detach_refused" not in await resumed.read_body()


async def test_a_body_in_several_reads_does_not_start_a_header_deadline():
    # A body larger than one socket read (256 KiB) arrives in two: its second part is read
    # after aiohttp took the request from its queue, before the handler began. It is body,
    # not a next request's head: the reply outlasts the header timeout and is whole.
    engine = fast_engine(delay_ms=50.0, jitter_ms=0.0)
    app = create_app(engine, ServerConfig(guard=GuardConfig(header_timeout_s=0.3)))
    async with running(app) as url:
        body = b'{"prompt": "x", "max_tokens": 20}' + b" " * 300_000
        response = await raw_request(f"{url}/v1/replies", "POST", body)
        async with asyncio.timeout(10):
            streamed = await response.read_body()
    assert response.status == 200
    assert streamed.count(b"event: token") == 20 and b"event: done" in streamed


async def test_an_allowed_page_may_read_when_to_retry():
    # The SDKs a page runs read Retry-After (a 429's wait) and X-Should-Retry (a 409 is not
    # retried): a browser hides every header the answer does not expose from the page.
    async with serve_with(GuardConfig(cors_origins=("https://chat.example",), per_minute=1)) as url:
        headers = {"Origin": "https://chat.example"}
        statuses = []
        for _ in range(2):
            response = await raw_request(f"{url}/wait?max_tokens=1", headers=headers)
            await response.read_body()
            statuses.append(response.status)
    assert statuses == [200, 429]
    assert "retry-after" in response.headers
    exposed = {
        name.strip().lower()
        for name in response.headers["access-control-expose-headers"].split(",")
    }
    assert exposed >= {"retry-after", "x-should-retry", "x-reply-id", "x-request-id"}


async def test_the_model_routes_vary_on_the_header_that_picks_their_shape():
    # GET /v1/models answers OpenAI's list, or Anthropic's page when anthropic-version is
    # sent: a cache between must not hand one client's form to the other.
    async with serve_with(GuardConfig(), gzip_min_bytes=1) as url:
        for target in (b"/v1/models", b"/v1/models/nope"):
            for extra in (b"", b"anthropic-version: 2023-06-01\r\nAccept-Encoding: gzip\r\n"):
                lines = await raw_head(
                    url,
                    b"GET "
                    + target
                    + b" HTTP/1.1\r\nHost: x\r\n"
                    + extra
                    + b"Connection: close\r\n\r\n",
                )
                vary = {value.lower() for value in header_values(lines, "vary")}
                assert "anthropic-version" in vary, (target, extra)
        lines = await raw_head(
            url, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        # Another route's answer takes one shape: it varies on no anthropic-version.
        assert "anthropic-version" not in {v.lower() for v in header_values(lines, "vary")}


async def test_a_client_at_its_limit_may_still_stop_and_poll_what_it_runs():
    # A client whose requests at once are all taken (streams open) must still be able to
    # stop a reply, or a background response, and poll one: those free room, or take none
    # for longer than their answer. A 429 would leave it no way to stop a background job.
    engine = fast_engine(delay_ms=20.0, jitter_ms=0.0)
    config = ServerConfig(guard=GuardConfig(max_concurrent=2), api_keys=("key-a",))
    auth = {"Authorization": "Bearer key-a", "Content-Type": "application/json"}
    job = {"input": "x", "background": True, "max_output_tokens": 100_000}
    async with running(create_app(engine, config)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=job, headers=auth) as created:
            assert created.status == 200
            background = (await created.json())["id"]
        streamed = {"prompt": "x", "max_tokens": 100_000, "resumable": True}
        async with (
            http.post(f"{url}/v1/replies", json=streamed, headers=auth) as first,
            http.post(f"{url}/v1/replies", json=streamed, headers=auth) as second,
        ):
            assert (first.status, second.status) == (200, 200)
            async with http.post(f"{url}/v1/replies", json=streamed, headers=auth) as third:
                assert third.status == 429  # the limit holds for what makes a reply
            async with http.get(f"{url}/v1/responses/{background}", headers=auth) as polled:
                assert polled.status == 200
            # a read that follows the events (stream=true) is a stream: it still needs room
            async with http.get(
                f"{url}/v1/responses/{background}?stream=true", headers=auth
            ) as followed:
                assert followed.status == 429
            async with http.post(f"{url}/v1/responses/{background}/cancel", headers=auth) as r:
                assert r.status == 200
                assert (await r.json())["status"] == "cancelled"
            reply_id = second.headers["X-Reply-Id"]
            async with http.post(f"{url}/v1/replies/{reply_id}/cancel", headers=auth) as r:
                assert r.status == 200
                assert (await r.json())["cancel_requested"] is True
            async with http.delete(f"{url}/v1/responses/{background}", headers=auth) as r:
                assert r.status == 200


async def test_a_reply_answered_whole_whose_client_left_is_named_by_its_access_log_line(
    caplog: pytest.LogCaptureFixture,
):
    # The reply was started (its tokens are counted) though its body was never sent: the
    # line of a client that left names it, as a stream's does.
    caplog.set_level(logging.INFO, logger="replystream.access")
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200}
    async with serve_engine(fast_engine(delay_ms=20.0, jitter_ms=0.0)) as url:
        parts = urlsplit(url)
        for request_id, path, body in (
            ("left-chat", "/v1/chat/completions", chat),
            ("left-messages", "/v1/messages", {**chat, "model": "simulated"}),
        ):
            data = json.dumps(body).encode()
            _, writer = await asyncio.open_connection(parts.hostname, parts.port)
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Request-Id: {request_id}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()
            await asyncio.sleep(0.3)  # some tokens made, far from the whole reply
            writer.close()
            await writer.wait_closed()

        def logged() -> dict[str, dict[str, object]]:
            lines = (
                json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"
            )
            return {line["request_id"]: line for line in lines if "request_id" in line}

        await wait_for(lambda: {"left-chat", "left-messages"} <= logged().keys())
    for request_id in ("left-chat", "left-messages"):
        line = logged()[request_id]
        assert line["status"] == "client_gone", line
        assert isinstance(line["reply_id"], str) and len(line["reply_id"]) == 24, line
