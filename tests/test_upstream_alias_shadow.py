"""An alias named as a model an upstream lists (learned by its ``/models`` probe, not written
in the routes file), over a real aiohttp upstream on a loopback socket and an
``UpstreamEngine`` served by replystream: the alias wins, as the docs say, and the relay says
so in its log once, however many probes find the model again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream


def shadow_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "replystream.upstream"
        and r.levelno == logging.WARNING
        and "alias" in r.getMessage()
    ]


async def test_an_alias_shadowing_a_listed_model_wins_and_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    upstream = Upstream(["gpt-4o-mini", "llama"])
    async with running(upstream.app()) as base:
        engine = UpstreamEngine(
            UpstreamConfig(
                (UpstreamTarget(f"{base}/v1"),),
                aliases=(("gpt-4o-mini", "llama"),),
                health_s=0.05,
            )
        )
        async with running(create_app(engine)) as url:
            ask = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            got = await post_events(f"{url}/v1/chat/completions", {**ask, "stream": True})
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
            await asyncio.sleep(0.3)  # several probe rounds find the model again
            [warning] = shadow_warnings(caplog)
    assert upstream.bodies[-1]["model"] == "llama"  # the alias's model, not the listed one
    assert f"the upstream at {base}/v1 lists a model named 'gpt-4o-mini'" in warning
    assert "requests for 'gpt-4o-mini' go to 'llama'" in warning


async def test_an_upstream_listing_no_aliased_name_logs_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    upstream = Upstream(["llama"])
    async with running(upstream.app()) as base:
        engine = UpstreamEngine(
            UpstreamConfig((UpstreamTarget(f"{base}/v1"),), aliases=(("gpt-4o-mini", "llama"),))
        )
        async with running(create_app(engine)) as url:
            ask = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            got = await post_events(f"{url}/v1/chat/completions", {**ask, "stream": True})
            assert got.status == 200 and upstream.bodies[-1]["model"] == "llama"
    assert shadow_warnings(caplog) == []
