"""What a client, ``/healthz`` and the log are told when an upstream's words concern our own
key: an upstream that repeats the key it was sent (in a refusal, an error mid-reply) has it
withheld, and one that refuses our key is told to be configured where that key is.

The relay is ``replystream serve --engine upstream`` in a child process, its keys given as an
operator does (a routes file's ``api_key_env``, ``--upstream-api-key``); the upstream is a
small aiohttp app in this process on a loopback port.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.chat_upstream import ChatUpstream
from tests.processes import replica
from tests.sse_client import post_events

pytestmark = pytest.mark.slow

ROUTES_KEY, FLAG_KEY = "sk-live-routes-0123456789", "sk-live-flag-9876543210"


def chunk(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class EchoingUpstream(ChatUpstream):
    """Repeats the key it was sent in every error, as some hosted APIs do; the last message
    of a chat says which error: ``who`` (a 401), ``bad`` (a 400 whose code and param hold
    the key too), ``mid`` (an error chunk after some text)."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        ask = (await request.json())["messages"][-1]["content"]
        if ask == "who":
            error = {"message": f"Incorrect API key provided: {key}.", "type": "auth"}
            return web.json_response({"error": error}, status=401)
        if ask == "bad":
            error = {"message": f"{key} may not ask this", "code": f"no_{key}", "param": key}
            return web.json_response({"error": error}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk({"choices": [{"index": 0, "delta": {"content": "one "}}]}))
        await response.write(chunk({"error": {"message": f"the quota of {key} is spent"}}))
        return response


class RefusingUpstream(EchoingUpstream):
    """Refuses every key, its ``GET /models`` too: the health probe is refused as well."""

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Incorrect API key"}}, status=401)


@asynccontextmanager
async def relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, upstream: type[ChatUpstream] = EchoingUpstream
) -> AsyncIterator[tuple[str, Path]]:
    """The relay in front of two ``upstream``s: ``a``, its key from the routes file's
    ``api_key_env``; ``b``, the key for all, from ``--upstream-api-key``. Yields the relay's
    URL and the routes file."""
    async with running(upstream().app()) as a, running(upstream().app()) as b:
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f'[[upstreams]]\nurl = "{a}/v1"\napi_key_env = "ECHO_KEY"\nmodels = ["a"]\n'
            f'[[upstreams]]\nurl = "{b}/v1"\nmodels = ["b"]\n'
        )
        monkeypatch.setenv("ECHO_KEY", ROUTES_KEY)
        args = ("--upstream-routes", str(routes), "--upstream-api-key", FLAG_KEY)
        async with replica("--engine", "upstream", *args) as (_, url):
            yield url, routes


async def ask(url: str, model: str, content: str) -> tuple[int, bytes]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": True}
    got = await post_events(f"{url}/v1/chat/completions", body)
    return got.status, got.raw


async def test_an_upstream_repeating_our_key_has_it_withheld_everywhere_it_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    async with relay(tmp_path, monkeypatch) as (url, _):
        told = []
        for model in ("a", "b"):
            status, raw = await ask(url, model, "bad")
            assert status == 400, raw
            error = json.loads(raw)["error"]
            assert error["message"].endswith("answered 400: (key withheld) may not ask this")
            assert error["code"] == "upstream_rejected" and error["param"] is None, error
            told.append(raw)
            status, raw = await ask(url, model, "mid")
            assert status == 200 and b"one " in raw, raw
            assert b"the quota of (key withheld) is spent" in raw, raw
            told.append(raw)
            status, raw = await ask(url, model, "who")
            assert status == 502, raw
            assert b"Incorrect API key provided" not in raw  # a 401 body is not quoted
            told.append(raw)
            status, raw = await ask(url, model, "mid")  # its third failure: its circuit opens
            told.append(raw)
        # Every circuit open: the last problem of each, told to whoever asks.
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as response:
            health = await response.read()
        assert response.status == 503 and health.count(b"(key withheld)") == 2, health
        told.append(health)
    for raw in told:
        assert ROUTES_KEY.encode() not in raw and FLAG_KEY.encode() not in raw, raw
        assert b"sk-live" not in raw, raw  # nor any part of either


async def test_a_refusal_of_our_key_names_where_the_key_is_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    async with relay(tmp_path, monkeypatch) as (url, routes):
        messages = {}
        for model in ("a", "b"):
            status, raw = await ask(url, model, "who")
            assert status == 502, raw
            messages[model] = json.loads(raw)["error"]["message"]
    assert messages["a"].endswith(
        f"answered 401: it refused our API key, set by {routes}: upstreams[0].api_key_env "
        "($ECHO_KEY)"
    ), messages
    assert messages["b"].endswith(
        "answered 401: it refused our API key, set by --upstream-api-key"
    ), messages


async def test_a_health_probe_refused_names_where_the_key_is_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    async with relay(tmp_path, monkeypatch, RefusingUpstream) as (url, routes):
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as response:
            status, health = response.status, await response.json()
    a, b = (upstream["url"] for upstream in tomllib.loads(routes.read_text())["upstreams"])
    assert status == 503, health
    assert health["reason"] == (
        f"the upstream at {a} answered 401: it refused our API key, set by {routes}: "
        "upstreams[0].api_key_env ($ECHO_KEY); "
        f"the upstream at {b} answered 401: it refused our API key, set by --upstream-api-key"
    ), health


async def test_a_refusal_when_no_key_is_configured_says_none_is():
    async with running(EchoingUpstream().app()) as upstream:
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/v1"),)))
        async with running(create_app(engine)) as url:
            status, raw = await ask(url, "m", "who")
        await engine.aclose()
    assert status == 502, raw
    assert json.loads(raw)["error"]["message"] == (
        f"the upstream at {upstream}/v1 answered 401: it wants an API key, and none is "
        "configured for it"
    )


async def test_a_health_probe_refused_when_no_key_is_configured_says_none_is():
    async with running(RefusingUpstream().app()) as upstream:
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/v1"),)))
        async with (
            running(create_app(engine)) as url,
            aiohttp.ClientSession() as http,
            http.get(f"{url}/healthz") as response,
        ):
            status, health = response.status, await response.json()
        await engine.aclose()
    assert status == 503, health
    assert health["reason"] == (
        f"the upstream at {upstream}/v1 answered 401: it wants an API key, and none is "
        "configured for it"
    )
