"""What the server tells of each request: ``/metrics`` counts each body as it went on the
wire (gzipped when it was; an error answered before the first token too), and each
access-log line of a reply route says how its request ended (``outcome``, ``reason``), in
the words ``replystream_replies_total`` counts replies by."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, get_args

import aiohttp
import pytest

from replystream.delivery.frame_transport import Ending as ReaderEnding
from replystream.delivery.policy import DeliveryPolicy
from replystream.server import create_app, running
from replystream.server.reply_endings import READER_CUTS
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for
from tests.processes import launch, ready_url, stop
from tests.rawhttp import RawResponse, raw_request
from tests.scripted_engine import GroupedPushEngine
from tests.test_websocket import client_frame, open_raw_websocket

CHAT = [{"role": "user", "content": "x"}]


async def post(
    url: str, path: str, body: dict[str, Any], request_id: str, **headers: str
) -> RawResponse:
    sent = {"Content-Type": "application/json", "X-Request-Id": request_id, **headers}
    return await raw_request(f"{url}{path}", "POST", json.dumps(body).encode(), sent)


def sent_total(metrics: bytes, series: str, endpoint: str) -> float:
    found = re.search(
        rb'replystream_%s_total\{endpoint="%s"\} (\S+)'
        % (series.encode(), re.escape(endpoint.encode())),
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


async def test_a_poll_of_a_stored_response_counts_the_object_it_was_answered_with(access_lines):
    """``GET /v1/responses/{id}`` answers with the response's object, its text: a reply's
    content written to a client, as a stream of the same response's events is, and counted
    as the same reader's stream would be (under the route it reads on), one event each, as it
    went on the wire. It was counted nowhere."""
    engine = fast_engine(delay_ms=1.0, jitter_ms=0.0, reply_text="word " * 400)
    background = {"input": "x", "max_output_tokens": 400, "background": True}
    async with running(create_app(engine)) as url:
        created = json.loads(await (await post(url, "/v1/responses", background, "bg")).read_body())
        path = f"/v1/responses/{created['id']}"
        polls: list[bytes] = []
        while not polls or json.loads(polls[-1])["status"] != "completed":  # as SDKs wait
            polls.append(await (await raw_request(f"{url}{path}")).read_body())
            await asyncio.sleep(0.02)
        zipped = await raw_request(f"{url}{path}", headers={"Accept-Encoding": "gzip"})
        wire = await zipped.read_body()
        metrics = await metrics_of(url)
    assert zipped.headers["content-encoding"] == "gzip"
    assert gzip.decompress(wire) == polls[-1] and len(wire) < len(polls[-1]) / 4
    route = "/v1/responses/{response_id}"
    assert sent_total(metrics, "bytes_sent", route) == sum(map(len, polls)) + len(wire)
    assert sent_total(metrics, "events_sent", route) == len(polls) + 1
    # The poll itself made or read no reply to the end: its line says no outcome.
    polled = [line for line in access_lines().values() if line["path"] == path]
    assert polled and {(line["outcome"], line["reason"]) for line in polled} == {(None, None)}


# How each request ended, as its access-log line says.

# A reply of up to 399 tokens never reaches the banned word; one of 400 is moderated there.
REPLY_TEXT = "lorem " * 399 + "forbidden"
LONG = 399  # tokens: 2 s at 5 ms each, far more than any step below takes
SERVER = ["--engine", "simulated", "--delay-ms", "5", "--jitter-ms", "0", "--ban", "forbidden"]
SERVER += ["--reply-text", REPLY_TEXT, "--shutdown-grace-s", "0"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class AccessLog:
    """A server process's stderr, read as it comes; its access-log lines by request id."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: dict[str, dict[str, Any]] = {}  # the last line of each request id
        self.every: list[dict[str, Any]] = []  # (a WebSocket's replies share its request id)
        self._reading = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            _, found, text = raw.decode().partition(" replystream.access ")
            if found and text.startswith("{"):
                line = json.loads(text)
                self.lines[line["request_id"]] = line
                self.every.append(line)

    async def line(self, request_id: str) -> dict[str, Any]:
        await wait_for(lambda: request_id in self.lines, timeout_s=15)
        return self.lines[request_id]

    async def aclose(self) -> None:
        async with asyncio.timeout(15):
            await self._reading  # to the end of the stream: the process has exited


@contextlib.asynccontextmanager
async def logged_server(
    *args: str,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, AccessLog]]:
    process = await launch(*args, "--log-level", "INFO", stderr=asyncio.subprocess.PIPE)
    assert process.stderr is not None
    log = AccessLog(process.stderr)
    try:
        yield process, await ready_url(process), log
    finally:
        await stop(process)
        await log.aclose()


async def test_each_line_of_a_reply_route_says_how_its_request_ended():
    ask_chat = {"messages": CHAT, "stream": True}
    async with logged_server(*SERVER) as (process, url, log):
        # Ended with their replies: finished in each dialect, streamed or whole; moderated;
        # refused as it started (an error body before any event).
        for request_id, path, body in (
            ("chat", "/v1/chat/completions", {**ask_chat, "max_tokens": 3}),
            ("messages", "/v1/messages", {**ask_chat, "max_tokens": 3, "model": "simulated"}),
            ("responses", "/v1/responses", {"input": "x", "max_output_tokens": 3, "stream": True}),
            ("native", "/v1/replies", {"prompt": "x", "max_tokens": 3}),
            ("whole", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}),
            ("moderated", "/v1/replies", {"prompt": "x", "max_tokens": LONG + 1}),
            (
                "refused",
                "/v1/chat/completions",
                {**ask_chat, "tools": TOOLS, "tool_choice": "required"},
            ),
        ):
            await (await post(url, path, body, request_id)).read_body()
        # Stopped by a cancel request, its reader sending the end.
        ask = {"prompt": "x", "max_tokens": LONG, "resumable": True}
        stopped = await post(url, "/v1/replies", ask, "cancelled")
        reply_id = stopped.headers["x-reply-id"]
        await (await post(url, f"/v1/replies/{reply_id}/cancel", {}, "the-cancel")).read_body()
        await stopped.read_body()
        # Read again once ended: the log's end says how (the reason is the producer's alone).
        again = {"X-Request-Id": "resumed"}
        await (await raw_request(f"{url}/v1/replies/{reply_id}/stream", headers=again)).read_body()
        # Left by its client: stopped with it (a reply nobody may resume), or going on for
        # its client to come back (a resumable one).
        long_chat = {**ask_chat, "max_tokens": LONG}
        (await post(url, "/v1/chat/completions", long_chat, "gone")).writer.close()
        (await post(url, "/v1/replies", ask, "detached")).writer.close()
        # Answered at once, its reply going on without it.
        background = {"input": "x", "max_output_tokens": LONG, "background": True}
        await (await post(url, "/v1/responses", background, "background")).read_body()
        # Cut by the server's shutdown.
        cut = await post(url, "/v1/replies", {"prompt": "x", "max_tokens": LONG}, "shutdown")
        for left in ("gone", "detached"):
            await log.line(left)  # its client's leaving seen before the server stops
        process.terminate()
        await cut.read_body()
        assert await process.wait() == 0
        await log.aclose()
    said = {
        request_id: (line["status"], line["outcome"], line["reason"])
        for request_id, line in log.lines.items()
    }
    assert said == {
        "chat": (200, "finished", None),
        "messages": (200, "finished", None),
        "responses": (200, "finished", None),
        "native": (200, "finished", None),
        "whole": (200, "finished", None),
        "moderated": (200, "moderated", "banned_phrase"),
        "refused": (400, "rejected", "unsupported_parameter"),
        "cancelled": (200, "cancelled", "cancelled"),
        "the-cancel": (200, None, None),  # names the reply, made none
        "resumed": (200, "cancelled", None),
        "gone": ("client_gone", "cancelled", "client_gone"),
        "detached": ("client_gone", "detached", None),
        "background": (200, "detached", None),
        "shutdown": (200, "shutdown", "shutdown"),
    }
    assert log.lines["the-cancel"]["reply_id"] == reply_id


def test_every_way_a_reader_cuts_itself_has_its_outcome():
    # Its other endings are its reply's (``ended``) or its client's (``client_gone``).
    assert {*READER_CUTS, "ended", "client_gone"} == set(get_args(ReaderEnding))


@pytest.fixture
def access_lines(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="replystream.access")

    def lines() -> dict[str, dict[str, Any]]:
        found = (
            json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"
        )
        return {line["request_id"]: line for line in found if line["request_id"]}

    return lines


async def test_a_reply_that_failed_says_its_error_code(access_lines):
    # After its first tokens (in-band), and before its first (a JSON error body).
    ask = {"messages": CHAT, "max_tokens": 20, "stream": True}
    for fail_after, request_id in ((2, "mid-stream"), (0, "before")):
        async with running(create_app(fast_engine(fail_after=fail_after))) as url:
            await (await post(url, "/v1/chat/completions", ask, request_id)).read_body()
            await wait_for(lambda: request_id in access_lines())  # noqa: B023
    said = {k: (v["status"], v["outcome"], v["reason"]) for k, v in access_lines().items()}
    assert said == {
        "mid-stream": (200, "errored", "generation_failed"),
        "before": (500, "errored", "generation_failed"),
    }


async def test_a_reader_cut_as_slow_says_slow_client(access_lines):
    # 200 tokens of 128 KB pushed at once to a client that reads nothing for a while.
    engine = GroupedPushEngine(["y" * (128 << 10)] * 200, group=200)
    policy = DeliveryPolicy(slow_client_bytes=256 << 10, slow_client_s=600.0)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        slow = await post(url, "/v1/replies", {"prompt": "x"}, "slow")
        await wait_for(lambda: "slow" in access_lines(), timeout_s=30)
        await slow.aclose()
    line = access_lines()["slow"]
    assert (line["status"], line["outcome"], line["reason"]) == (200, "slow_client", "slow_client")


# A WebSocket: a line for each ``reply`` message, once it has ended, and the socket's own.


async def until_ended(ws: aiohttp.ClientWebSocketResponse, tag: str) -> list[str]:
    """The messages of ``tag``'s reply as they came (others' set aside) until it has ended."""
    mine: list[str] = []
    async with asyncio.timeout(15):
        while not mine or json.loads(mine[-1])["type"] not in ("done", "error", "moderated"):
            text = await ws.receive_str()
            if json.loads(text)["id"] == tag:
                mine.append(text)
    return mine


async def until_token(ws: aiohttp.ClientWebSocketResponse, tag: str) -> None:
    async with asyncio.timeout(15):
        while True:
            message = await ws.receive_json()
            if message["id"] == tag and message["type"] == "token":
                return


async def test_each_reply_on_a_websocket_has_a_line_that_says_how_it_ended():
    """One socket, each of its replies ending its own way: each has the line the same request
    would have had over HTTP, under the socket's request id, with its tag and what it sent;
    the socket's own line says how many replies it was asked for."""
    ask = {"type": "reply", "prompt": "x"}
    # Two replies at once are all its client may run (the socket is one request, each
    # further reply running on it one more).
    async with logged_server(*SERVER, "--max-concurrent-per-client", "2") as (_, url, log):
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(f"{url}/v1/ws", headers={"X-Request-Id": "socket"}) as ws,
        ):
            await ws.send_json({**ask, "id": "done", "max_tokens": 3})
            done = await until_ended(ws, "done")
            await ws.send_json({**ask, "id": "moderated", "max_tokens": LONG + 1})
            await until_ended(ws, "moderated")
            # Refused as it started (by the engine), and before (a field out of range).
            await ws.send_json({**ask, "id": "refused", "min_tokens": 5, "max_tokens": 2})
            refused = await until_ended(ws, "refused")
            await ws.send_json({**ask, "id": "invalid", "max_tokens": -1})
            await until_ended(ws, "invalid")
            # Two running, a third over its client's limit; one stopped by a cancel message,
            # one still running as its socket closes.
            for tag in ("cancelled", "gone"):
                await ws.send_json({**ask, "id": tag, "max_tokens": LONG})
                await until_token(ws, tag)
            await ws.send_json({**ask, "id": "limited"})
            await until_ended(ws, "limited")
            await ws.send_json({"type": "cancel", "id": "cancelled"})
            await until_ended(ws, "cancelled")
            # A resumable one goes on without its socket, for its client to come back to.
            await ws.send_json({**ask, "id": "kept", "max_tokens": LONG, "resumable": True})
            await until_token(ws, "kept")
        await log.line("socket")  # the socket's line comes once every reply on it has ended
    lines = [line for line in log.every if line["request_id"] == "socket"]
    assert {(line["method"], line["path"]) for line in lines} == {("GET", "/v1/ws")}
    *replies, socket_line = lines
    said = {
        line["tag"]: (line["status"], line["outcome"], line["reason"], line["reply_id"] is None)
        for line in replies
    }
    assert said == {
        "done": (200, "finished", None, False),
        "moderated": (200, "moderated", "banned_phrase", False),
        "refused": (400, "rejected", "invalid_value", True),
        "invalid": (400, None, None, True),
        "limited": (429, None, None, True),
        "cancelled": (200, "cancelled", "cancelled", False),
        "gone": ("client_gone", "cancelled", "client_gone", False),
        "kept": ("client_gone", "detached", None, False),
    }
    by_tag = {line["tag"]: line for line in replies}
    assert by_tag["done"]["reply_id"] == json.loads(done[0])["reply_id"]

    # What each sent, as the metrics count it: each message one event, its frame's bytes
    # (a head of 2 bytes under 126 of text, else 4); a refusal as its reply started is its
    # one error message; a message refused before then counted nothing.
    def frames(texts: list[str]) -> int:
        return sum(len(text) + (2 if len(text) < 126 else 4) for text in texts)

    assert (by_tag["done"]["events"], by_tag["done"]["bytes"]) == (len(done), frames(done))
    assert (by_tag["refused"]["events"], by_tag["refused"]["bytes"]) == (1, frames(refused))
    assert (by_tag["limited"]["events"], by_tag["limited"]["bytes"]) == (None, None)
    assert all(line["ms"] >= 0 for line in replies)
    assert (socket_line["status"], socket_line["outcome"], socket_line["replies"]) == (101, None, 8)
    assert "tag" not in socket_line


def socket_lines(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, dict[str, Any]]:
    """The access-log lines of a WebSocket's replies, by tag."""
    found = [json.loads(r.getMessage()) for r in caplog.records if r.name == "replystream.access"]
    mine = [line for line in found if line["request_id"] == request_id]
    return {line["tag"]: line for line in mine if line.get("tag")}


async def test_a_websocket_reply_that_failed_says_its_error_code(caplog):
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with (
        running(create_app(fast_engine(fail_after=2))) as url,
        aiohttp.ClientSession() as http,
        http.ws_connect(f"{url}/v1/ws", headers={"X-Request-Id": "failing"}) as ws,
    ):
        await ws.send_json({"type": "reply", "id": "failed", "prompt": "x", "max_tokens": 20})
        await until_ended(ws, "failed")
        await wait_for(lambda: "failed" in socket_lines(caplog, "failing"))
    line = socket_lines(caplog, "failing")["failed"]
    said = (line["status"], line["outcome"], line["reason"])
    assert said == (200, "errored", "generation_failed")


async def test_a_websocket_reply_cut_as_slow_says_slow_client(caplog):
    caplog.set_level(logging.INFO, logger="replystream.access")
    # 200 tokens of 128 KB pushed at once to a socket that reads nothing.
    engine = GroupedPushEngine(["y" * (128 << 10)] * 200, group=200)
    policy = DeliveryPolicy(slow_client_bytes=256 << 10, slow_client_s=600.0)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        _, writer = await open_raw_websocket(url, b"X-Request-Id: unread\r\n")
        try:
            writer.write(client_frame(b'{"type":"reply","id":"slow","prompt":"x"}'))
            await wait_for(lambda: "slow" in socket_lines(caplog, "unread"), timeout_s=30)
        finally:
            writer.close()
    line = socket_lines(caplog, "unread")["slow"]
    assert (line["status"], line["outcome"], line["reason"]) == (200, "slow_client", "slow_client")
    assert line["events"] >= 1 and line["bytes"] > 256 << 10
