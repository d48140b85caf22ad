"""SSE and WebSocket followers of the same reply: the same events, limits and endings.

Both transports run the one ``Follower`` (delivery/follower.py); only the framing differs.
Each case reads one reply over a real loopback server, once as SSE (``POST /v1/replies``) and
once as a WebSocket reply message, and compares what a client learns: every event's type,
number and data, and how the stream ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from replystream.delivery.policy import DeliveryPolicy
from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.server.app import create_app
from replystream.server.context import MANAGER_KEY
from replystream.server.serve import running
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import wait_for
from tests.rawhttp import raw_request
from tests.scripted_engine import GroupedPushEngine

TRANSPORTS = ["sse", "ws"]


@dataclass
class Seen:
    events: list[tuple[str, int | None, Any]]  # (type, seq, data) in order
    closed_with: int | None = None  # a WebSocket's close code, if the server closed it

    @property
    def types(self) -> list[str]:
        return [kind for kind, _, _ in self.events]

    def last(self) -> tuple[str, int | None, Any]:
        return self.events[-1]


async def over_sse(url: str, body: dict[str, Any], *, pause_s: float = 0.0) -> Seen:
    response = await raw_request(f"{url}/v1/replies", "POST", json.dumps(body).encode())
    await asyncio.sleep(pause_s)  # a client that does not read meanwhile
    async with asyncio.timeout(60):
        raw = await response.read_body()
    events = EventParser().feed(raw)
    return Seen([(e.type, int(e.id) if e.id else None, json.loads(e.data)) for e in events])


async def over_ws(url: str, body: dict[str, Any], *, pause_s: float = 0.0) -> Seen:
    seen = Seen([])
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/v1/ws") as ws:
        await ws.send_json({"type": "reply", "id": "t", **body})
        await asyncio.sleep(pause_s)
        async with asyncio.timeout(60):
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                message = json.loads(msg.data)
                seen.events.append((message["type"], message.get("seq"), message["data"]))
                if message["type"] in ("done", "error", "moderated"):
                    break
        if not ws.closed:
            # A reply's end leaves the socket open; a cut closes it right after its notice.
            with contextlib.suppress(TimeoutError):
                await ws.receive(timeout=1.0)
        if ws.closed:
            seen.closed_with = ws.close_code
    return seen


async def follow(transport: str, url: str, body: dict[str, Any], **kw: float) -> Seen:
    return await (over_sse if transport == "sse" else over_ws)(url, body, **kw)


def engine(**config: Any) -> SimulatedEngine:
    return SimulatedEngine(SimulatedConfig(**{"delay_ms": 2.0, "jitter_ms": 0.0, **config}))


async def test_both_transports_carry_the_same_events_numbered_alike():
    body = {"prompt": "x", "max_tokens": 12, "seed": 7, "batch_tokens": 3}
    async with running(create_app(engine())) as url:
        sse, ws = await follow("sse", url, body), await follow("ws", url, body)
    without_ids = [(kind, seq, data) for kind, seq, data in sse.events if kind != "reply"]
    assert [e for e in ws.events if e[0] != "reply"] == without_ids
    assert sse.types[-2:] == ["usage", "done"]
    assert [seq for _, seq, _ in sse.events] == list(range(1, len(sse.events) + 1))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_generator_error_ends_either_transport_with_the_same_error(transport):
    async with running(create_app(engine(fail_after=4))) as url:
        seen = await follow(transport, url, {"prompt": "x", "max_tokens": 20})
    kind, seq, data = seen.last()
    assert (kind, data["error"]["code"]) == ("error", "generation_failed")
    assert seen.types.count("token") == 4 and seq == 6  # numbered: it is in the log
    assert seen.closed_with is None  # one reply's end is not the socket's


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_reader_far_behind_is_cut_for_byte_lag_on_either_transport(transport):
    # 200 tokens of 128 KB pushed at once to a client that reads nothing for 2 s; the stall
    # deadline is far away, so only the byte limit can cut it.
    policy = DeliveryPolicy(slow_client_bytes=256 << 10, slow_client_s=600.0)
    app = create_app(GroupedPushEngine(["y" * (128 << 10)] * 200, group=200), ServerConfig(policy))
    async with running(app) as url:
        seen = await follow(transport, url, {"prompt": "x"}, pause_s=2.0)
        await wait_for(lambda: not app[MANAGER_KEY].replies, timeout_s=20)
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    kind, seq, data = seen.last()
    # Decided by the follower, so never in the log: it takes no number (an SSE parser keeps
    # the last id it saw).
    assert kind == "error" and seq == (seen.events[-2][1] if transport == "sse" else None)
    assert data["error"]["code"] == "slow_client"
    assert re.search(r"bytes behind", data["error"]["message"])
    assert seen.types.count("token") < 150
    assert b'outcome="slow_client"} 1.0' in metrics
    if transport == "ws":
        assert seen.closed_with == 1008  # the socket itself could not keep up


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_cancelled_reply_ends_either_transport_with_cancelled(transport):
    app = create_app(engine(delay_ms=20.0))
    async with running(app) as url:

        async def cancel_soon() -> None:
            await wait_for(lambda: bool(app[MANAGER_KEY].replies), timeout_s=10)
            await asyncio.sleep(0.2)
            (reply_id,) = app[MANAGER_KEY].replies
            async with aiohttp.ClientSession() as http:
                await http.post(f"{url}/v1/replies/{reply_id}/cancel")

        seen, _ = await asyncio.gather(
            follow(transport, url, {"prompt": "x", "max_tokens": 200}), cancel_soon()
        )
    kind, _, data = seen.last()
    assert (kind, data["error"]["code"]) == ("error", "cancelled")
    assert 0 < seen.types.count("token") < 200
