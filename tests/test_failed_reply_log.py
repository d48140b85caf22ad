"""A reply the engine failed is logged at WARNING naming which reply it was: at the default
log level that line is all an operator has (the access log is INFO), and with the access log
on, the name is what finds the request's line. A streamed reply and one answered whole with
an id name their reply id; one answered whole with none (``stream: false`` on
``/v1/replies``) names its request id, which its access-log line and its client's
``X-Request-Id`` give."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import pytest

from replystream.server import create_app, running
from tests.conftest import fast_engine

ASK = [{"role": "user", "content": "x"}]


async def failed(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """POST ``body`` to a route of the server at ``url`` whose engine fails; the reply id its
    response names (or the request id it was given, for a reply with none)."""
    async with session.post(url, json=body, headers={"X-Request-Id": "req-failed-1"}) as got:
        await got.read()
        return got.headers.get("X-Reply-Id") or "req-failed-1"


async def test_a_failed_reply_is_logged_naming_its_reply_or_its_request(
    caplog: pytest.LogCaptureFixture,
):
    app = create_app(fast_engine(fail_after=2))
    caplog.set_level(logging.WARNING, logger="replystream")
    async with running(app) as url, aiohttp.ClientSession() as session:
        named = [
            await failed(session, f"{url}/v1/replies", {"prompt": "x"}),
            await failed(session, f"{url}/v1/chat/completions", {"messages": ASK}),
            await failed(session, f"{url}/v1/replies", {"prompt": "x", "stream": False}),
        ]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert named[2] == "req-failed-1" and "req-failed-1" not in named[:2], named
    assert lines == [
        f"reply {named[0]}: generation failed: simulated failure after 2 tokens",
        f"reply {named[1]}: generation failed: simulated failure after 2 tokens",
        "request req-failed-1: generation failed: simulated failure after 2 tokens",
    ], lines
