"""GET /v1/ws over a real loopback socket: tagged replies side by side, cancel, close, bad input."""

import asyncio
import gc
import json
import logging
import socket
import struct
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from replystream.delivery.policy import DeliveryPolicy
from replystream.server import create_app, native, running, serving
from replystream.server.auth import KEY_RING
from replystream.server.context import LOCAL_STORE_KEY, METRICS_KEY
from replystream.server.guard import GATE_KEY
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from replystream.server.socket_session import CLOSE_TIMEOUT_S, Session
from replystream.server.ws_transport import PING_FRAME, SocketKeepalive, WebSocketTransport
from tests.conftest import fast_engine, wait_for
from tests.sse_client import post_events


async def read_until_ended(ws: aiohttp.ClientWebSocketResponse, tags: set[str]) -> list[Any]:
    """Every message until each tag's reply has ended (``done`` or ``error``)."""
    messages: list[Any] = []
    open_tags = set(tags)
    async with asyncio.timeout(10):
        while open_tags:
            message = await ws.receive_json()
            messages.append(message)
            if message["type"] in ("done", "error", "moderated"):
                open_tags.discard(message["id"])
    return messages


def of(messages: list[Any], tag: str | None) -> list[Any]:
    return [m for m in messages if m["id"] == tag]


def text_of(messages: list[Any]) -> str:
    return "".join(m["data"]["text"] for m in messages if m["type"] == "token")


async def test_two_replies_interleave_on_one_socket_each_complete_and_tagged():
    engine = fast_engine(delay_ms=4, jitter_ms=1)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        expected_a = (await post_events(f"{url}/v1/replies", {"prompt": "a", "seed": 1})).text
        body_b = {"prompt": "b", "seed": 2, "max_tokens": 30}
        expected_b = (await post_events(f"{url}/v1/replies", body_b)).text
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "a", "prompt": "a", "seed": 1})
            await ws.send_json({"type": "reply", "id": "b", **body_b})
            messages = await read_until_ended(ws, {"a", "b"})
    for tag, expected in (("a", expected_a), ("b", expected_b)):
        mine = of(messages, tag)
        types = [m["type"] for m in mine]
        assert types[0] == "reply" and types[-2:] == ["usage", "done"]
        assert set(types[1:-2]) == {"token"}
        assert text_of(mine) == expected
        assert [m["seq"] for m in mine] == list(range(1, len(mine) + 1))
        assert {m["reply_id"] for m in mine} == {mine[0]["data"]["reply_id"]}
    tags = [m["id"] for m in messages]
    assert tags.index("b") < len(of(messages, "a"))  # b started before a was done
    assert engine.stats().finished == 4


async def test_cancel_message_stops_generation():
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "x", "prompt": "p"})
            seen: list[Any] = []
            while len([m for m in seen if m["type"] == "token"]) < 2:
                seen.append(await ws.receive_json())
            await ws.send_json({"type": "cancel", "id": "x"})
            rest = await read_until_ended(ws, {"x"})
            assert rest[-1]["type"] == "error"
            assert rest[-1]["data"]["error"]["code"] == "cancelled"
            # The socket stays usable: the same tag may start again.
            await ws.send_json({"type": "reply", "id": "x", "prompt": "p", "max_tokens": 2})
            again = await read_until_ended(ws, {"x"})
            assert again[-1]["type"] == "done"
    stats = engine.stats()
    assert stats.cancelled == 1 and stats.finished == 1
    assert stats.steps < 120


async def test_closing_the_socket_stops_every_reply_on_it():
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            for tag in ("one", "two"):
                await ws.send_json({"type": "reply", "id": tag, "prompt": "p"})
            tokens = 0
            while tokens < 4:
                tokens += (await ws.receive_json())["type"] == "token"
        await wait_for(lambda: engine.stats().cancelled == 2)
    assert engine.stats().active == 0 and engine.stats().steps < 60


async def test_replies_stopped_by_a_closed_socket_are_freed_without_the_cycle_collector():
    """Each running reply's task is cancelled when its socket goes. A cancelled task keeps its
    CancelledError, whose traceback holds the task's frames; with the task in their locals, the
    reply (its log and everything it touched) waited for a full collection, which the server's
    collector settings make rare: RSS grew 78 MiB per socket cut with 8,000 replies running."""
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    tags = ("freed-one", "freed-two")
    gc.collect()
    gc.disable()
    try:
        async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{url}/v1/ws") as ws:
                for tag in tags:
                    await ws.send_json({"type": "reply", "id": tag, "prompt": "p"})
                tokens = 0
                while tokens < 4:
                    tokens += (await ws.receive_json())["type"] == "token"
            await wait_for(lambda: engine.stats().cancelled == 2)
            await asyncio.sleep(0.05)  # the session's tasks end after their replies
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [
            task
            for task in gc.garbage
            if isinstance(task, asyncio.Task) and task.get_name().startswith("ws-reply-freed")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


@pytest.mark.parametrize(
    ("message", "tag", "code"),
    [
        ("not json", None, "invalid_json"),
        ("[1, 2]", None, "invalid_json"),
        (json.dumps({"type": "reply", "prompt": "x"}), None, "missing_required_parameter"),  # no id
        (json.dumps({"type": "reply", "id": ""}), None, "invalid_value"),
        (json.dumps({"type": "dance", "id": "t"}), "t", "invalid_value"),
        (json.dumps({"id": "t", "prompt": "x"}), "t", "missing_required_parameter"),  # no type
        (json.dumps({"type": None, "id": "t"}), "t", "invalid_value"),
        (json.dumps({"type": "reply", "id": "t", "prompt": "x", "max_tokens": 0}), "t", None),
        (json.dumps({"type": "reply", "id": "t"}), "t", "invalid_value"),
        (json.dumps({"type": "reply", "id": "t", "prompt": "x", "stream": False}), "t", None),
        (  # the socket is kept alive by the server's pings, not per reply
            json.dumps({"type": "reply", "id": "t", "prompt": "x", "keepalive_s": 0.5}),
            "t",
            "unsupported_parameter",
        ),
        (json.dumps({"type": "cancel", "id": "nobody"}), "nobody", "reply_not_found"),
    ],
)
async def test_bad_messages_get_an_error_message_and_the_socket_lives_on(message, tag, code):
    engine = fast_engine()
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_str(message)
            error = await ws.receive_json()
            assert error["type"] == "error" and error["id"] == tag
            assert set(error["data"]["error"]) == {"message", "type", "param", "code"}
            assert error["data"]["error"]["code"] == (code or "invalid_value")
            said, param = error["data"]["error"]["message"], error["data"]["error"]["param"]
            assert not said.startswith(f"{param}: {param} "), said  # named once
            await ws.send_bytes(b"\x00")
            assert (await ws.receive_json())["data"]["error"]["code"] == "invalid_json"
            await ws.send_json({"type": "reply", "id": "ok", "prompt": "x", "max_tokens": 3})
            ok = await read_until_ended(ws, {"ok"})
    assert ok[-1]["type"] == "done" and text_of(ok) == "A language model "


async def test_a_message_past_the_body_limit_is_refused_and_the_other_replies_go_on():
    """A message larger than --max-body-bytes is an ``error`` message, as a body that large
    is a 413 over HTTP: the reply running beside it goes on. Past four times the limit the
    server does not read it: the socket closes with 1009 (message too big)."""
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    config = ServerConfig(max_body_bytes=10_000)
    big = {"type": "reply", "id": "big", "prompt": "x" * 20_000}
    async with running(create_app(engine, config)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "ok", "prompt": "x", "max_tokens": 20})
            await ws.send_json(big)
            # Under the limit in characters, past it in bytes: counted as a body is, in bytes.
            await ws.send_str(json.dumps({**big, "prompt": "é" * 6_000}, ensure_ascii=False))
            messages = await read_until_ended(ws, {"ok"})
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({**big, "prompt": "x" * 50_000})
            closed = await ws.receive()
    errors = [m for m in messages if m["type"] == "error"]
    assert [e["data"]["error"]["code"] for e in errors] == ["body_too_large"] * 2
    assert "10000 bytes" in errors[0]["data"]["error"]["message"]
    assert of(messages, "ok")[-1]["type"] == "done"
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1009


async def test_each_reply_on_a_socket_counts_against_requests_per_minute():
    """The socket is one request of its client's rate, and each reply it starts is one
    more: a client cannot start replies without end over one socket past the limit."""
    config = ServerConfig(guard=GuardConfig(per_minute=3))
    async with running(create_app(fast_engine(), config)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:  # the upgrade: one of three
            for tag in ("a", "b"):
                await ws.send_json({"type": "reply", "id": tag, "prompt": "x", "max_tokens": 2})
                assert (await read_until_ended(ws, {tag}))[-1]["type"] == "done"
            await ws.send_json({"type": "reply", "id": "c", "prompt": "x", "max_tokens": 2})
            refused = await ws.receive_json()
        async with http.post(f"{url}/v1/replies", json={"prompt": "x"}) as over_http:
            status = over_http.status
    assert refused["type"] == "error" and refused["id"] == "c"
    assert refused["data"]["error"]["code"] == "rate_limited"
    assert refused["data"]["retry_after"] >= 1
    assert status == 429  # the same client's budget, whichever way it asks


async def test_a_socket_is_logged_with_its_upgrade_status(caplog: pytest.LogCaptureFixture):
    # Its handler is cancelled when the client's connection goes: the line still says 101,
    # not that the client left before an answer.
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "a", "prompt": "x", "max_tokens": 2})
            assert (await read_until_ended(ws, {"a"}))[-1]["type"] == "done"

        def lines() -> list[dict[str, Any]]:
            logged = (r for r in caplog.records if r.name == "replystream.access")
            return [json.loads(r.getMessage()) for r in logged]

        await wait_for(lambda: len(lines()) == 2)
    # Its reply's line (its status as over HTTP), then the socket's.
    assert [(line["path"], line["status"], line.get("tag")) for line in lines()] == [
        ("/v1/ws", 200, "a"),
        ("/v1/ws", 101, None),
    ]


@pytest.mark.parametrize("leaving", ["close", "reset"])
async def test_a_client_gone_before_the_upgrade_is_answered_is_no_server_error(
    caplog: pytest.LogCaptureFixture, leaving: str
):
    # A loaded server answers an upgrade late, and a client whose open timeout passed has
    # left by then: the answer cannot be written. That is the client's leaving, not a
    # failure of the server's: no ERROR, no traceback; the access log says the client left.
    caplog.set_level(logging.INFO, logger="replystream")
    upgrade = (
        b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    async with running(create_app(fast_engine())) as url:
        host, port = url.removeprefix("http://").split(":")
        # Blocking calls: the server's loop (this one) reads the upgrade only once the
        # client has already gone, as a busy server would.
        client = socket.create_connection((host, int(port)))
        client.sendall(upgrade)
        if leaving == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        await wait_for(lambda: any(r.name == "replystream.access" for r in caplog.records))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"]
    # On 3.11 aiohttp starts the handler a turn after the request is read, by when the
    # client's leaving has been read too and the answer's write is refused. From 3.12 it
    # starts it at once: the 101 is written before the server can know, and logged as sent.
    gone = [("/v1/ws", "client_gone")]
    assert [(line["path"], line["status"]) for line in lines] in (
        [gone] if sys.version_info < (3, 12) else [gone, [("/v1/ws", 101)]]
    )


async def test_cancelling_an_unknown_tag_is_not_found_as_over_http():
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/replies/nobody/cancel") as response:
            assert response.status == 404
            over_http = (await response.json())["error"]
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "cancel", "id": "nobody"})
            error = (await ws.receive_json())["data"]["error"]
    assert error["code"] == over_http["code"] == "reply_not_found"
    assert error["type"] == over_http["type"] == "invalid_request_error"
    assert error["param"] == "id"


async def test_replies_per_socket_are_limited_and_tags_unique():
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    config = ServerConfig(ws_max_replies=1)
    async with running(create_app(engine, config)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "a", "prompt": "x", "max_tokens": 5})
            await ws.send_json({"type": "reply", "id": "a", "prompt": "x"})
            await ws.send_json({"type": "reply", "id": "b", "prompt": "x"})
            messages = [await ws.receive_json()]
            while messages[-1]["type"] != "done":
                messages.append(await ws.receive_json())
    errors = [m["data"]["error"]["code"] for m in messages if m["type"] == "error"]
    assert errors == ["duplicate_id", "too_many_replies"]
    assert engine.stats().started == 1


async def test_error_mid_reply_is_an_error_message_for_that_tag():
    async with running(create_app(fast_engine(fail_after=2))) as url:
        async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "f", "prompt": "x"})
            messages = await read_until_ended(ws, {"f"})
    assert [m["type"] for m in messages] == ["reply", "token", "token", "error"]
    assert messages[-1]["data"]["error"]["code"] == "generation_failed"


async def test_keys_on_the_upgrade_or_in_the_first_message():
    config = ServerConfig(api_keys=("sk-ws-key",))
    engine = fast_engine()
    async with running(create_app(engine, config)) as url, aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(f"{url}/v1/ws", headers={"Authorization": "Bearer nope"})
        assert refused.value.status == 401
        start = {"type": "reply", "id": "k", "prompt": "x", "max_tokens": 2}
        headers = {"Authorization": "Bearer sk-ws-key"}
        async with http.ws_connect(f"{url}/v1/ws", headers=headers) as ws:
            await ws.send_json(start)
            assert (await read_until_ended(ws, {"k"}))[-1]["type"] == "done"
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "auth", "api_key": "sk-ws-key"})
            await ws.send_json(start)
            assert (await read_until_ended(ws, {"k"}))[-1]["type"] == "done"
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json(start)  # no key first
            error = await ws.receive_json()
            assert error["data"]["error"]["code"] == "invalid_api_key"
            assert error["data"]["error"]["type"] == "invalid_request_error"  # as over HTTP
            closed = await ws.receive()
            assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 4401
    assert engine.stats().started == 2


async def test_a_ping_or_pong_before_the_auth_message_is_not_taken_for_it():
    config = ServerConfig(api_keys=("sk-ws-key",))
    async with running(create_app(fast_engine(), config)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.ping(b"first")  # control frames are no messages (RFC 6455 5.5)
            await ws.pong(b"unsolicited")
            await ws.send_json({"type": "auth", "api_key": "sk-ws-key"})
            await ws.send_json({"type": "reply", "id": "k", "prompt": "x", "max_tokens": 2})
            assert (await read_until_ended(ws, {"k"}))[-1]["type"] == "done"


async def test_a_socket_keyed_in_its_first_message_counts_against_its_key_not_its_address():
    """A browser's socket gives its key in its first message, after the upgrade was counted
    against its address: it was never counted against its key, so the key's limit did not
    hold on it, and other keys behind the same address were refused."""
    guard = GuardConfig(max_concurrent=1)
    config = ServerConfig(api_keys=("sk-one", "sk-two"), guard=guard)
    start = {"type": "reply", "id": "r", "prompt": "x", "max_tokens": 2}
    async with running(create_app(fast_engine(), config)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as one:
            await one.send_json({"type": "auth", "api_key": "sk-one"})
            await one.send_json(start)
            assert (await read_until_ended(one, {"r"}))[-1]["type"] == "done"
            # The key has its one request open: the socket.
            headers = {"Authorization": "Bearer sk-one"}
            async with http.post(f"{url}/v1/replies", json={"prompt": "x"}, headers=headers) as r:
                over_http = r.status
            async with http.ws_connect(f"{url}/v1/ws") as again:
                await again.send_json({"type": "auth", "api_key": "sk-one"})
                refused = await again.receive_json()
                closed = await again.receive()
            # Another key from the same address has nothing open.
            async with http.ws_connect(f"{url}/v1/ws") as two:
                await two.send_json({"type": "auth", "api_key": "sk-two"})
                await two.send_json(start)
                assert (await read_until_ended(two, {"r"}))[-1]["type"] == "done"
    assert over_http == 429
    assert refused["data"]["error"]["code"] == "rate_limited" and refused["data"]["retry_after"]
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1013


async def test_a_key_revoked_while_its_socket_is_open_starts_no_more_replies():
    config = ServerConfig(api_keys=("sk-old",))
    app = create_app(fast_engine(delay_ms=20.0, jitter_ms=0.0), config)
    async with running(app) as url, aiohttp.ClientSession() as http:
        headers = {"Authorization": "Bearer sk-old"}
        async with http.ws_connect(f"{url}/v1/ws", headers=headers) as ws:
            await ws.send_json({"type": "reply", "id": "long", "prompt": "x", "max_tokens": 20})
            first = await ws.receive_json()
            app[KEY_RING].replace(["sk-new"])  # what a reload of --api-keys-file does
            await ws.send_json({"type": "reply", "id": "late", "prompt": "x", "max_tokens": 2})
            messages = [first, *await read_until_ended(ws, {"long", "late"})]
    refused = [m for m in messages if m["id"] == "late"]
    assert [m["type"] for m in refused] == ["error"]
    assert refused[0]["data"]["error"]["code"] == "invalid_api_key"
    # What the key started before goes on to its end.
    assert [m for m in messages if m["id"] == "long"][-1]["type"] == "done"


@pytest.mark.parametrize("keys", [(), ("sk-ws-key",)])
async def test_an_empty_key_is_refused_as_a_wrong_key_is(keys):
    engine = fast_engine()
    app = create_app(engine, ServerConfig(api_keys=keys))
    async with running(app) as url, aiohttp.ClientSession() as http:
        answers = {}
        for key in ("sk-wrong", ""):
            if not keys and key:
                continue  # a server without keys has no wrong key: it passes a key on
            async with http.ws_connect(f"{url}/v1/ws") as ws:
                await ws.send_json({"type": "auth", "api_key": key})
                await ws.send_json({"type": "reply", "id": "r", "prompt": "x", "max_tokens": 2})
                error = await ws.receive_json(timeout=5)
                closed = await ws.receive(timeout=5)
                answers[key] = (error["data"]["error"]["code"], closed.type, closed.data)
    assert answers[""] == ("invalid_api_key", aiohttp.WSMsgType.CLOSE, 4401)
    assert answers.get("sk-wrong", answers[""]) == answers[""]
    assert engine.stats().started == 0


@pytest.mark.parametrize(
    "spelling",
    [
        '{"type": "auth", "api_key": "sk-mine"}',
        '{"type": "\\u0061uth", "api_key": "sk-mine"}',
        '{"api_key": "sk-mine", "type": "a\\u0075th"}',
    ],
)
async def test_an_auth_message_is_the_same_message_whatever_its_json_spelling(spelling):
    # A server without keys takes the key for a relay to pass on: once, then a second key is
    # refused. Every JSON spelling of the first message must be taken the same way.
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_str(spelling)
            await ws.send_json({"type": "auth", "api_key": "sk-other"})
            error = await ws.receive_json()
            await ws.send_json({"type": "reply", "id": "r", "prompt": "x", "max_tokens": 2})
            ended = await read_until_ended(ws, {"r"})
    assert error["data"]["error"]["param"] == "api_key"
    assert "has its key already" in error["data"]["error"]["message"]
    assert ended[-1]["type"] == "done"


async def open_raw_websocket(
    url: str, extra_headers: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket handshake by hand, so the test controls whether anything is ever read."""
    reader, writer, _head = await open_raw_websocket_with_head(url, extra_headers)
    return reader, writer


async def open_raw_websocket_with_head(
    url: str, extra_headers: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """``open_raw_websocket``, with the server's handshake answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        + extra_headers
        + b"\r\n"
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101")
    return reader, writer, head


def client_frame(payload: bytes) -> bytes:
    """One masked text frame (clients must mask; a zero mask keeps the payload as is)."""
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + b"\0\0\0\0" + payload


async def test_a_socket_that_is_never_read_is_cut_and_its_reply_stopped():
    # 1,000 tokens of 20 kB in 3 s: the socket's buffers fill long before the reply ends.
    words = " ".join(f"{n:05d}" * 4000 for n in range(1000))
    engine = fast_engine(reply_text=words, delay_ms=3, jitter_ms=0)
    policy = DeliveryPolicy(slow_client_s=0.3, slow_client_bytes=64 << 20)
    app = create_app(engine, ServerConfig(policy=policy))
    async with serving(app) as server:
        _reader, writer = await open_raw_websocket(server.url)
        try:
            start = {"type": "reply", "id": "s", "prompt": "x"}
            writer.write(client_frame(json.dumps(start).encode()))
            await wait_for(lambda: engine.stats().cancelled == 1, timeout_s=10)
            # The server lets the connection go too, though this client still reads nothing
            # (its close frame cannot leave, so it must not wait for it forever).
            connections = server.runner.server
            assert connections is not None
            await wait_for(lambda: not connections.connections, timeout_s=15)
        finally:
            writer.close()
    assert engine.stats().finished == 0 and engine.stats().steps < 1000
    assert 'outcome="slow_client"} 1.0' in app[METRICS_KEY].render().decode()


async def test_a_reply_cancelled_while_being_admitted_still_ends_with_an_error_message():
    engine = fast_engine(first_token_ms=50)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "c", "prompt": "x"})
            await ws.send_json({"type": "cancel", "id": "c"})
            messages = await read_until_ended(ws, {"c"})
    assert [m["type"] for m in messages] == ["reply", "error"]
    assert messages[-1]["data"]["error"]["code"] == "cancelled"
    assert engine.stats().steps == 0


async def test_a_long_reply_nobody_may_resume_does_not_keep_its_log_while_read():
    engine = fast_engine(delay_ms=2, jitter_ms=0)
    app = create_app(engine)
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "long", "prompt": "x"})
            tokens = 0
            while tokens < 100:
                tokens += (await ws.receive_json())["type"] == "token"
            assert app[LOCAL_STORE_KEY].stats().entries < 40
            assert (await read_until_ended(ws, {"long"}))[-1]["type"] == "done"


async def test_a_failure_inside_one_reply_leaves_the_socket_and_other_replies_alone(monkeypatch):
    encode = WebSocketTransport.encode

    def failing_encode(self, entries):
        if '"id":"boom"' in self._head and any(e.event == "token" for e in entries):
            raise RuntimeError("injected")
        return encode(self, entries)

    monkeypatch.setattr(WebSocketTransport, "encode", failing_encode)
    engine = fast_engine()
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "boom", "prompt": "x"})
            await ws.send_json({"type": "reply", "id": "fine", "prompt": "x", "max_tokens": 3})
            messages = await read_until_ended(ws, {"boom", "fine"})
    assert of(messages, "boom")[-1]["data"]["error"]["code"] == "internal_error"
    assert of(messages, "fine")[-1]["type"] == "done"
    await wait_for(lambda: engine.stats().active == 0)


async def test_a_plain_get_is_a_400_in_the_error_shape():
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/ws") as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["code"] == "upgrade_required" and error["type"] == "invalid_request_error"


async def test_an_upgrade_over_http_1_0_or_of_another_version_is_refused_naming_13():
    # HTTP/1.0 has no 101 (its Upgrade header is to be ignored); a client asking a WebSocket
    # version other than 13 is told the one the server speaks. Either is told what is wrong
    # with its upgrade, not to send one (it did).
    key = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    upgrade = b"Upgrade: websocket\r\nConnection: Upgrade\r\n" + key
    async with running(create_app(fast_engine())) as url:
        parts = urlsplit(url)
        # 7 and 8: drafts before RFC 6455, which aiohttp alone would accept.
        for version, ws_version, said in (
            (b"1.0", b"13", "needs HTTP/1.1"),
            (b"1.1", b"99", "version 13, not 99"),
            (b"1.1", b"8", "version 13, not 8"),
            (b"1.1", b"7", "version 13, not 7"),
        ):
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
            writer.write(
                b"GET /v1/ws HTTP/"
                + version
                + b"\r\nHost: x\r\n"
                + upgrade
                + b"Sec-WebSocket-Version: "
                + ws_version
                + b"\r\n\r\n"
            )
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = next(
                int(line.split(":", 1)[1])
                for line in head.split("\r\n")
                if line.startswith("content-length:")
            )
            body = await reader.readexactly(length)
            writer.close()
            assert head.split("\r\n")[0].split()[1] == "400", head
            assert "sec-websocket-version: 13\r\n" in head
            error = json.loads(body)["error"]
            assert error["code"] == "upgrade_required" and said in error["message"], error


async def read_raw_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One unmasked server frame: (its first byte: FIN, RSV bits and opcode; its payload)."""
    head = await reader.readexactly(2)
    size = head[1] & 0x7F
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2), "big")
    elif size == 127:
        size = int.from_bytes(await reader.readexactly(8), "big")
    return head[0], await reader.readexactly(size)


async def read_raw_frames(reader: asyncio.StreamReader) -> list[tuple[int, bytes]]:
    """Every unmasked server frame (opcode, payload) until the connection ends."""
    frames: list[tuple[int, bytes]] = []
    async with asyncio.timeout(15):
        while True:
            try:
                first, payload = await read_raw_frame(reader)
            except asyncio.IncompleteReadError:
                return frames
            frames.append((first & 0x0F, payload))


def masked_close_frame() -> bytes:
    return bytes([0x88, 0x82]) + b"\0\0\0\0" + (1000).to_bytes(2, "big")


async def test_a_message_that_fails_anywhere_is_an_error_for_its_tag_and_other_replies_go_on(
    monkeypatch, caplog
):
    parse = native.parse_reply_request

    def parse_with_a_bug(body, defaults, max_prompt_chars, *, caller, model):
        if body.prompt == "bug":
            raise RuntimeError("injected")
        return parse(body, defaults, max_prompt_chars, caller=caller, model=model)

    monkeypatch.setattr("replystream.server.socket_replies.parse_reply_request", parse_with_a_bug)
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    bad = {
        "bug": {"type": "reply", "id": "bug", "prompt": "bug"},
        "unknown": {"type": 7, "id": "unknown"},
        "refused": {"type": "reply", "id": "refused", "prompt": "x", "stop": 5},
    }
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "long", "prompt": "x", "max_tokens": 60})
            assert (await ws.receive_json())["type"] == "reply"
            for message in bad.values():
                await ws.send_json(message)
            await ws.send_str('{"type": "reply", "id": ')
            messages = await read_until_ended(ws, {"long", *bad})
            await ws.send_json({"type": "reply", "id": "after", "prompt": "x", "max_tokens": 3})
            after = await read_until_ended(ws, {"after"})
    for tag in bad:
        (error,) = of(messages, tag)
        assert error["type"] == "error"
        assert set(error["data"]["error"]) == {"message", "type", "param", "code"}
    assert of(messages, "bug")[0]["data"]["error"]["code"] == "internal_error"
    assert of(messages, "refused")[0]["data"]["error"]["param"] == "stop"
    assert of(messages, None)[0]["data"]["error"]["code"] == "invalid_json"
    long = of(messages, "long")
    assert long[-1]["type"] == "done" and len(text_of(long).split()) == 60
    assert after[-1]["type"] == "done"
    # A client's mistake is one log line; only the bug comes with a traceback.
    failures = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert [str(failure) for failure in failures] == ["injected"]


async def test_a_session_that_fails_after_the_upgrade_closes_with_1011_and_no_http_response(
    monkeypatch,
):
    async def broken_run(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(Session, "run", broken_run)
    async with serving(create_app(fast_engine())) as server:
        reader, writer = await open_raw_websocket(server.url)
        try:
            frames = await read_raw_frames(reader)
            writer.write(masked_close_frame())
        finally:
            writer.close()
    assert b"HTTP/1.1" not in b"".join(payload for _, payload in frames)
    closes = [payload for opcode, payload in frames if opcode == 0x8]
    assert closes and int.from_bytes(closes[0][:2], "big") == 1011


async def test_the_socket_refuses_compression_so_every_frame_is_plain():
    async with serving(create_app(fast_engine())) as server:
        offer = b"Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n"
        reader, writer, head = await open_raw_websocket_with_head(server.url, offer)
        try:
            assert b"permessage-deflate" not in head.lower()
            # An error message (sent by the session) and a reply's events (written by its
            # transport) alike: no RSV1 bit, the payload is the JSON itself.
            writer.write(client_frame(b"not json"))
            start = {"type": "reply", "id": "p", "prompt": "x", "max_tokens": 2}
            writer.write(client_frame(json.dumps(start).encode()))
            messages: list[Any] = []
            async with asyncio.timeout(10):
                while not messages or messages[-1]["type"] != "done":
                    first, payload = await read_raw_frame(reader)
                    assert first == 0x81  # a final text frame, RSV1 (compressed) clear
                    messages.append(json.loads(payload))
        finally:
            writer.close()
    assert messages[0]["data"]["error"]["code"] == "invalid_json"
    assert [m["type"] for m in messages[1:]] == ["reply", "token", "token", "usage", "done"]


async def test_a_reader_slightly_slower_than_its_reply_is_not_dropped_by_keepalive_pings():
    # A reply sent every 2 ms, read every 4 ms: the reader falls behind by a few hundred ms a
    # second, a ping queued behind that backlog is answered late, and the slow-client limits
    # (30 s, 50 MB) are far away. Only they may cut a reader that is behind.
    engine = fast_engine(reply_text="word " * 5000, delay_ms=2, jitter_ms=0)
    policy = DeliveryPolicy(keepalive_s=0.5, slow_client_s=30, slow_client_bytes=50 << 20)
    app = create_app(engine, ServerConfig(policy=policy))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:  # aiohttp answers pings it reads
            await ws.send_json({"type": "reply", "id": "slow", "prompt": "x"})
            loop = asyncio.get_running_loop()
            until = loop.time() + 4.0  # eight keep-alive periods
            kinds = []
            while loop.time() < until:
                message = await ws.receive(timeout=5)
                assert message.type == aiohttp.WSMsgType.TEXT, (message, loop.time() - until)
                kinds.append(json.loads(message.data)["type"])
                await asyncio.sleep(0.004)
    assert kinds[0] == "reply" and set(kinds[1:]) == {"token"} and len(kinds) > 300


async def test_an_idle_peer_that_never_answers_a_ping_is_cut_with_1008():
    # The reply is over and the client reads nothing more and answers nothing: the socket is
    # idle, so it is pinged after keepalive_s; no pong within slow_client_s cuts it as a slow
    # client would be, with its close frame (which this client finds when it reads at last).
    policy = DeliveryPolicy(keepalive_s=0.4, slow_client_s=0.8)
    app = create_app(fast_engine(), ServerConfig(policy=policy))
    async with serving(app) as server:
        reader, writer = await open_raw_websocket(server.url)
        try:
            start = {"type": "reply", "id": "r", "prompt": "x", "max_tokens": 2}
            writer.write(client_frame(json.dumps(start).encode()))
            loop = asyncio.get_running_loop()
            started = loop.time()
            connections = server.runner.server
            assert connections is not None
            await wait_for(lambda: not connections.connections, timeout_s=10)
            cut_after = loop.time() - started
            frames = await read_raw_frames(reader)
        finally:
            writer.close()
    opcodes = [opcode for opcode, _ in frames]
    assert [json.loads(p)["type"] for op, p in frames if op == 0x1][-1] == "done"
    assert 0x9 in opcodes  # pinged once idle
    assert opcodes[-1] == 0x8
    assert int.from_bytes(frames[-1][1][:2], "big") == 1008 and frames[-1][1][2:] == b"slow_client"
    # Within the documented bound: keepalive_s and a quarter of it, then slow_client_s; then
    # the close waits CLOSE_TIMEOUT_S for an answer that never comes.
    assert 0.4 + 0.8 <= cut_after < 0.4 * 1.25 + 0.8 + CLOSE_TIMEOUT_S + 0.5


async def test_an_unanswered_ping_cuts_the_socket_once_slow_client_s_is_up():
    # slow_client_s far below a quarter of keepalive_s: the cut comes when the ping has
    # waited slow_client_s, not at the next keep-alive check a quarter period (2 s) later.
    policy = DeliveryPolicy(keepalive_s=8.0, slow_client_s=0.2)
    app = create_app(fast_engine(), ServerConfig(policy=policy))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws", autoping=False) as ws:
            loop = asyncio.get_running_loop()
            ping = await ws.receive(timeout=10)
            assert ping.type == aiohttp.WSMsgType.PING
            pinged = loop.time()
            close = await ws.receive(timeout=10)
            assert close.type == aiohttp.WSMsgType.CLOSE and close.extra == "slow_client"
            assert loop.time() - pinged < 0.2 + 1.2


async def test_an_idle_client_that_answers_pings_stays_connected():
    policy = DeliveryPolicy(keepalive_s=0.2, slow_client_s=0.5)
    app = create_app(fast_engine(), ServerConfig(policy=policy))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            # A reading client: aiohttp answers the pings it reads while it waits.
            first = asyncio.ensure_future(ws.receive())
            await asyncio.sleep(2.0)  # ten keep-alive periods
            assert not first.done(), first.result()
            await ws.send_json({"type": "reply", "id": "after", "prompt": "x", "max_tokens": 2})
            assert json.loads((await first).data)["type"] == "reply"
            assert (await read_until_ended(ws, {"after"}))[-1]["type"] == "done"


class _Wire:
    """What ``SocketKeepalive`` sees of a transport: what it wrote."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def is_closing(self) -> bool:
        return False


def test_keepalive_pings_only_an_idle_socket_and_gives_an_unanswered_ping_slow_client_s():
    wire = _Wire()
    keepalive = SocketKeepalive(wire, keepalive_s=2.0, patience_s=30.0, now=0.0)  # type: ignore[arg-type]
    assert keepalive.period_s == 0.5
    now = 0.0
    while now < 120.0:  # two minutes of frames, a ping's answer never needed
        now += 0.5
        keepalive.sent = True
        assert keepalive.check(now) is None
    assert wire.frames == []
    assert keepalive.check(now + 1.5) is None and wire.frames == []
    assert keepalive.check(now + 2.0) is None and wire.frames == [PING_FRAME]
    assert keepalive.check(now + 31.5) is None  # behind: as long as any write may take
    keepalive.sent = True  # frames behind the ping change nothing about its answer
    assert keepalive.check(now + 32.0) == "no answer to a ping for 30 s"
    keepalive.answered()
    assert keepalive.check(now + 32.5) is None and wire.frames == [PING_FRAME]
    assert keepalive.check(now + 34.5) is None and wire.frames == [PING_FRAME] * 2


HANDSHAKE = (
    b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def frame(payload: bytes, *, masked: bool = True, opcode: int = 0x1) -> bytes:
    """One final client frame, of any length; masked with a key that changes the bytes."""
    size = len(payload)
    if size < 126:
        length = bytes([size])
    elif size < 1 << 16:
        length = bytes([126]) + size.to_bytes(2, "big")
    else:
        length = bytes([127]) + size.to_bytes(8, "big")
    if not masked:
        return bytes([0x80 | opcode]) + length + payload
    key = b"\x11\x22\x33\x44"
    body = bytes(byte ^ key[i % 4] for i, byte in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | length[0]]) + length[1:] + key + body


def reply_frame(tag: str, *, masked: bool = True, padding: int = 0) -> bytes:
    ask = {"type": "reply", "id": tag, "prompt": "x" * padding or "x", "max_tokens": 2}
    return frame(json.dumps(ask).encode(), masked=masked)


async def frames_until_closed(reader: asyncio.StreamReader) -> list[tuple[int, bytes]]:
    frames = await read_raw_frames(reader)
    assert frames and frames[-1][0] == 0x8, frames  # the last one is a close frame
    return frames


def close_code(frames: list[tuple[int, bytes]]) -> int:
    return int.from_bytes(frames[-1][1][:2], "big")


@pytest.mark.parametrize("when", ["after a reply", "sent with the upgrade request"])
async def test_an_unmasked_client_frame_closes_the_socket_with_1002_and_one_log_line(
    when: str, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO)
    engine = fast_engine()
    async with serving(create_app(engine)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            if when == "after a reply":
                writer.write(HANDSHAKE)
                await reader.readuntil(b"\r\n\r\n")
                writer.write(reply_frame("good"))
                for _ in range(5):  # reply, two tokens, usage, done
                    _first, payload = await read_raw_frame(reader)
                assert json.loads(payload)["type"] == "done"
                writer.write(reply_frame("bad", masked=False))
            else:  # a client that did not wait for the upgrade's answer
                writer.write(HANDSHAKE + reply_frame("bad", masked=False))
                await reader.readuntil(b"\r\n\r\n")
            frames = await frames_until_closed(reader)
        finally:
            writer.close()
    assert close_code(frames) == 1002
    assert [opcode for opcode, _ in frames] == [0x8]  # the bad frame was never read
    assert engine.stats().finished == (1 if when == "after a reply" else 0)
    said = [r for r in caplog.records if "1002" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]


async def test_masked_frames_of_every_length_and_split_anywhere_are_read_as_sent():
    # Frames of 7-bit, 16-bit and 64-bit lengths, a ping among them, sent with the upgrade
    # request and then a few bytes at a time: the check follows every frame's bounds, so it
    # takes none of their payload bytes for a frame head.
    engine = fast_engine()
    policy = DeliveryPolicy(keepalive_s=None)
    async with serving(create_app(engine, ServerConfig(policy=policy))) as server:
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # Payload bytes (valid UTF-8) that would read as unmasked frame heads if taken for one.
        unmasked_looking = b"\x01\x05" * 40_000
        stream = (
            reply_frame("short")
            + frame(b"\x01\x05", opcode=0x9)
            + reply_frame("medium", padding=300)
            + reply_frame("long", padding=70_000)
            + frame(unmasked_looking)  # not JSON: an error message, the socket stays open
        )
        try:
            writer.write(HANDSHAKE + stream[:3])
            await reader.readuntil(b"\r\n\r\n")
            for start in range(3, len(stream), 7_001):
                writer.write(stream[start : start + 7_001])
                await writer.drain()
            messages: list[Any] = []
            async with asyncio.timeout(10):
                while sum(m.get("type") in ("done", "error") for m in messages) < 4:
                    opcode, payload = await read_raw_frame(reader)
                    if opcode & 0x0F == 0x1:
                        messages.append(json.loads(payload))
            writer.write(reply_frame("after", masked=False))
            frames = await frames_until_closed(reader)
        finally:
            writer.close()
    assert {m["id"] for m in messages if m["type"] == "done"} == {"short", "medium", "long"}
    assert [m["data"]["error"]["code"] for m in messages if m["type"] == "error"] == [
        "invalid_json"
    ]
    assert close_code(frames) == 1002


async def test_shutdown_closes_a_socket_still_waiting_for_its_key_at_once_with_1001():
    app = create_app(fast_engine(), ServerConfig(api_keys=("sk-ws-key",)))
    async with serving(app) as server, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{server.url}/v1/ws") as ws:  # no key yet
            await asyncio.sleep(0.1)
            started = time.monotonic()
            stopping = asyncio.create_task(server.shutdown(0.2))
            closed = await ws.receive(timeout=10)
            await stopping
            took = time.monotonic() - started
    # Not the key's wait running out (10 s) into a refusal of a key never asked for.
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1001
    assert took < 8, took


async def test_no_frame_follows_the_close_frame_of_a_refused_key():
    engine = fast_engine(delay_ms=2, jitter_ms=0, reply_text=" ".join(["w"] * 5000))
    async with serving(create_app(engine)) as server:
        reader, writer = await open_raw_websocket(server.url)
        try:
            writer.write(client_frame(b'{"type": "reply", "id": "a", "prompt": "x"}'))
            for _ in range(4):  # the reply is streaming
                await read_raw_frame(reader)
            writer.write(client_frame(b'{"type": "auth", "api_key": ""}'))
            frames = await read_raw_frames(reader)
        finally:
            writer.close()
    opcodes = [opcode for opcode, _ in frames]
    assert 0x8 in opcodes, opcodes
    after_close = opcodes[opcodes.index(0x8) + 1 :]
    assert after_close == [], f"{len(after_close)} frames after the close frame"
    assert int.from_bytes(frames[opcodes.index(0x8)][1][:2], "big") == 4401


async def test_a_message_naming_type_twice_is_refused_naming_type():
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_str('{"type": "cancel", "id": "q5", "type": "reply"}')
            error = await ws.receive_json(timeout=5)
    assert error["id"] == "q5"
    assert error["data"]["error"]["param"] == "type"
    assert "names type more than once" in error["data"]["error"]["message"]


@pytest.mark.parametrize(
    ("sent", "answer"),
    [
        (None, 1000),  # a close frame without a code
        (1000, 1000),
        (1001, 1000),
        (4000, 1000),
        (4999, 1000),
        # RFC 6455 7.4: codes no peer may send are a protocol error.
        (1005, 1002),
        (1006, 1002),
        (1015, 1002),
        (2999, 1002),
        (5000, 1002),
        (65535, 1002),
    ],
)
@pytest.mark.parametrize("keyed", [False, True], ids=["open", "waiting for its key"])
async def test_a_client_close_is_answered_1000_or_1002_for_a_code_no_peer_may_send(
    sent: int | None, answer: int, keyed: bool
):
    config = ServerConfig(api_keys=("sk-a",) if keyed else ())
    async with serving(create_app(fast_engine(), config)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(HANDSHAKE)
            await reader.readuntil(b"\r\n\r\n")
            if not keyed:  # a reply first: the session is reading messages
                writer.write(reply_frame("r"))
                for _ in range(5):  # reply, two tokens, usage, done
                    _first, payload = await read_raw_frame(reader)
                assert json.loads(payload)["type"] == "done"
            body = b"" if sent is None else sent.to_bytes(2, "big")
            writer.write(frame(body, opcode=0x8))
            frames = await frames_until_closed(reader)
        finally:
            writer.close()
    assert [opcode for opcode, _ in frames] == [0x8]
    assert close_code(frames) == answer


async def test_an_offered_subprotocol_is_not_echoed_and_not_logged(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG)
    async with serving(create_app(fast_engine())) as server:
        for _ in range(3):
            reader, writer, head = await open_raw_websocket_with_head(
                server.url, b"Sec-WebSocket-Protocol: foo, chat.v2\r\n"
            )
            try:
                writer.write(reply_frame("r"))
                for _ in range(5):  # reply, two tokens, usage, done: the socket works
                    _first, payload = await read_raw_frame(reader)
                assert json.loads(payload)["type"] == "done"
            finally:
                writer.close()
            # RFC 6455 4.2.2: a server that speaks none of the offered subprotocols answers
            # without the header (echoing one would claim to speak it).
            assert b"sec-websocket-protocol" not in head.lower()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


async def next_of(ws: aiohttp.ClientWebSocketResponse, tag: str, *types: str) -> Any:
    """The next message for ``tag`` (of one of ``types``, when given); others are skipped."""
    async with asyncio.timeout(10):
        while True:
            message = await ws.receive_json()
            if message["id"] == tag and (not types or message["type"] in types):
                return message


async def test_a_socket_runs_no_more_replies_at_once_than_its_client_may_have_requests():
    """--max-concurrent-per-client holds on a WebSocket as over HTTP: the socket is one open
    request, and each reply running on it past its first is one more. A client held to two
    requests at once ran eight replies at once over one socket (--ws-max-replies), and was
    let make an HTTP request beside them."""
    config = ServerConfig(guard=GuardConfig(max_concurrent=2))
    app = create_app(fast_engine(delay_ms=20.0, jitter_ms=0.0), config)
    gate = app[GATE_KEY]
    long = {"prompt": "x", "max_tokens": 500}
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            for tag in ("a", "b"):  # the socket with its first reply; the second reply
                await ws.send_json({"type": "reply", "id": tag, **long})
                assert (await next_of(ws, tag))["type"] == "reply"
            await ws.send_json({"type": "reply", "id": "c", **long})
            refused = await next_of(ws, "c")
            async with http.post(f"{url}/v1/replies", json={"prompt": "x"}) as over_http:
                status = over_http.status
            await ws.send_json({"type": "cancel", "id": "b"})
            await next_of(ws, "b", "error")
            await wait_for(lambda: sum(gate.open.values()) == 1)  # the socket with reply a
            # The room b held is free again, for another reply on the socket.
            await ws.send_json({"type": "reply", "id": "d", "prompt": "x", "max_tokens": 2})
            ended = await next_of(ws, "d", "done", "error")
    assert refused["type"] == "error", refused
    assert refused["data"]["error"]["code"] == "rate_limited"
    assert refused["data"]["retry_after"] >= 1
    assert status == 429
    assert ended["type"] == "done", ended
    await wait_for(lambda: not gate.open)  # the socket closed: nothing of it is counted


@pytest.mark.parametrize("named", ["model", "field"])
async def test_a_refused_message_quoting_a_long_name_is_one_short_log_line(
    caplog: pytest.LogCaptureFixture, named: str
):
    """A refusal's words quote what the client sent (``The model '...' does not exist``,
    ``unknown field '...'``), and its INFO line wrote them whole: a client's message of a
    1 MB name made a line of 1 MB, as often as it liked, and the log's room of 4 MiB filled
    with its lines while every other line was dropped."""
    caplog.set_level(logging.INFO, logger="replystream.websocket")
    name = "m" * 500_000
    message: dict[str, object] = {"type": "reply", "id": "t", "prompt": "x"}
    if named == "model":
        message["model"] = name
    else:
        message[name] = 1  # an unknown field
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json(message)
            error = (await ws.receive_json())["data"]["error"]
    assert error["code"] == ("model_not_found" if named == "model" else "unknown_parameter")
    assert name in error["message"]  # the client is told all of it
    (line,) = [r.getMessage() for r in caplog.records if r.name == "replystream.websocket"]
    assert line.startswith("websocket message 't' refused: ")
    assert len(line) < 500 and line.endswith(f" characters) ({error['code']})"), line[:500]
