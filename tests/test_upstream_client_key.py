"""Upstream credentials, as a gateway's operator configures them: an upstream where each
client has its own account gets the caller's own key (``pass_client_key = true`` in the
routes file, or ``--upstream-pass-client-key`` for upstreams without a key of their own);
every other upstream gets its configured key and never a client's.

The relay is ``replystream serve --engine upstream`` in a child process; the upstreams are
small aiohttp apps in this process on loopback ports, which record the ``Authorization`` they
are sent and refuse keys they do not know (401), as a hosted API does; the clients are the
official ``openai`` and ``anthropic`` SDKs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.processes import replica
from tests.rawhttp import raw_request
from tests.test_websocket import read_until_ended

pytestmark = pytest.mark.slow


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class KeyedUpstream:
    """An OpenAI-compatible upstream serving ``model`` to the holders of ``keys`` only."""

    def __init__(self, model: str, keys: set[str]) -> None:
        self.model, self.keys = model, keys
        self.url = ""  # its base URL once it runs
        self.sent: list[str | None] = []  # the Authorization of every request, probes too

    def _refusal(self, request: web.Request) -> web.Response | None:
        header = request.headers.get("Authorization")
        self.sent.append(header)
        if header is None or header.removeprefix("Bearer ") not in self.keys:
            error = {"message": "Incorrect API key provided", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=401)
        return None

    async def models(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        return refused or web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("hello ", "there"):
            await response.write(chunk(word))
        await response.write(chunk(None, "stop") + b"data: [DONE]\n\n")
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def requests(self) -> list[str | None]:
        """What the chat requests (not the probes) carried: probes send no key here."""
        return [h for h in self.sent if h is not None]


@asynccontextmanager
async def relay(
    tmp_path: Path, routes: str, upstreams: list[KeyedUpstream], *flags: str
) -> AsyncIterator[str]:
    """The relay in a child process; ``routes`` names the upstreams' URLs ``{0}``, ``{1}``..."""
    async with AsyncExitStack() as stack:
        for upstream in upstreams:
            upstream.url = await stack.enter_async_context(running(upstream.app())) + "/v1"
        path = tmp_path / "routes.toml"
        path.write_text(routes.format(*(u.url for u in upstreams)))
        _, url = await stack.enter_async_context(
            replica("--engine", "upstream", "--upstream-routes", str(path), *flags)
        )
        yield url


ROUTES = """
[[upstreams]]
url = "{0}"
pass_client_key = true
models = ["open"]

[[upstreams]]
url = "{1}"
api_key = "configured"
models = ["closed"]
"""


async def chat(url: str, key: str, model: str) -> str:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_an_upstream_told_to_gets_the_callers_own_key_and_the_others_their_configured_one(
    tmp_path: Path,
):
    hosted, private = (
        KeyedUpstream("open", {"alice", "bob"}),
        KeyedUpstream("closed", {"configured"}),
    )
    async with relay(tmp_path, ROUTES, [hosted, private]) as url:
        # Probed without a key, the upstream that takes the client's answers 401: it is up.
        async with aiohttp.ClientSession() as session, session.get(f"{url}/healthz") as health:
            assert health.status == 200, await health.text()
        assert await chat(url, "alice", "open") == "hello there"
        # Anthropic's SDK sends its key as x-api-key: that is the caller's key too.
        async with (
            anthropic.AsyncAnthropic(base_url=url, api_key="bob", max_retries=0) as bob,
            bob.messages.stream(
                model="open", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            ) as stream,
        ):
            message = await stream.get_final_message()
        assert message.content[0].type == "text" and message.content[0].text == "hello there"
        assert await chat(url, "alice", "closed") == "hello there"
    assert hosted.requests() == ["Bearer alice", "Bearer bob"]
    # The configured upstream never saw a client's key: its probes and the reply had its own.
    assert set(private.sent) == {"Bearer configured"}


async def test_a_client_key_the_upstream_refuses_is_the_clients_401_not_a_failover(
    tmp_path: Path,
):
    first, second = KeyedUpstream("open", {"alice"}), KeyedUpstream("open", {"alice"})
    routes = (
        '[[upstreams]]\nurl = "{0}"\nmodels = ["open"]\n\n'
        '[[upstreams]]\nurl = "{1}"\nmodels = ["open"]\npass_client_key = false\n'
    )
    # The flag covers upstreams without a key of their own unless the file says otherwise.
    async with relay(tmp_path, routes, [first, second], "--upstream-pass-client-key") as url:
        async with (
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="mallory", max_retries=0) as client,
            anthropic.AsyncAnthropic(base_url=url, api_key="mallory", max_retries=0) as mallory,
        ):
            for _ in range(4):  # more than --upstream-failures: still no circuit opened
                with pytest.raises(openai.AuthenticationError) as caught:
                    await client.chat.completions.create(
                        model="open", messages=[{"role": "user", "content": "hi"}], stream=True
                    )
                error = caught.value.body
                assert isinstance(error, dict) and error["code"] == "upstream_refused_client_key"
                assert "refused the API key you sent" in error["message"]
                assert "mallory" not in error["message"]
            # A 401 of the Anthropic route is in Anthropic's shape.
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await mallory.messages.create(
                    model="open", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
                )
            assert refused.value.body == {
                "type": "error",
                "error": {
                    "type": "authentication_error",
                    "message": f"the upstream at {first.url} answered 401: it refused the "
                    "API key you sent, which is passed on to it",
                    "code": "upstream_refused_client_key",
                    "param": None,
                },
                "request_id": refused.value.request_id,
            }
        assert await chat(url, "alice", "open") == "hello there"  # the upstream is not held out
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as got:
            metrics = await got.text()
    # Each refused request went to the first upstream only; the second, told not to take
    # the client's key, got none (and refused it, so it got no request).
    assert first.requests().count("Bearer mallory") == 5
    assert "Bearer mallory" not in second.requests()
    assert f'replystream_upstream_circuit{{upstream="{first.url}"}} 0.0' in metrics
    rejected = f'replystream_upstream_attempts{{result="rejected",upstream="{first.url}"}}'
    assert f"{rejected} 5.0" in metrics


def serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "replystream", "serve", "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_a_key_and_the_clients_key_for_one_upstream_are_refused_at_start_up(tmp_path: Path):
    both = tmp_path / "both.toml"
    both.write_text(
        '[[upstreams]]\nurl = "http://127.0.0.1:9/v1"\napi_key = "k"\npass_client_key = true\n'
    )
    for argv, says in (
        (
            ["--engine", "upstream", "--upstream-routes", str(both)],
            f"replystream serve: --upstream-routes {both}: upstreams[0].pass_client_key: the "
            "upstream gets the client's key or api_key, not both",
        ),
        (
            [
                "--engine",
                "upstream:http://127.0.0.1:9/v1",
                "--upstream-api-key",
                "k",
                "--upstream-pass-client-key",
            ],
            "replystream serve: --upstream-pass-client-key sends each client's key upstream, "
            "and --upstream-api-key gives a key for every upstream",
        ),
        (
            ["--engine", "simulated", "--upstream-pass-client-key"],
            "replystream serve: --upstream-pass-client-key is an option of the upstream engine",
        ),
    ):
        done = serve(*argv)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith(says), done.stderr


async def test_a_websockets_key_from_its_upgrade_or_its_first_message_is_passed_on():
    """A browser's socket sends its key in its first message; a server's, on the upgrade."""
    hosted = KeyedUpstream("open", {"alice", "bob"})
    async with running(hosted.app()) as upstream_url:
        hosted.url = f"{upstream_url}/v1"
        targets = (UpstreamTarget(hosted.url, pass_client_key=True, models=("open",)),)
        engine = UpstreamEngine(UpstreamConfig(targets))
        config = ServerConfig(api_keys=("alice", "bob"))
        start = {"type": "reply", "id": "t", "prompt": "hi"}
        async with running(create_app(engine, config)) as url, aiohttp.ClientSession() as http:
            upgrade = {"Authorization": "Bearer alice"}
            async with http.ws_connect(f"{url}/v1/ws", headers=upgrade) as ws:
                await ws.send_json(start)
                got = await read_until_ended(ws, {"t"})
                assert got[-1]["type"] == "done", got
            async with http.ws_connect(f"{url}/v1/ws") as ws:
                await ws.send_json({"type": "auth", "api_key": "bob"})
                await ws.send_json(start)
                assert (await read_until_ended(ws, {"t"}))[-1]["type"] == "done"
    assert hosted.requests() == ["Bearer alice", "Bearer bob"]


async def test_a_browser_socket_on_a_server_without_keys_gives_its_key_in_an_auth_message():
    """No keys here: the upstream checks them. A browser's socket cannot send one on the
    upgrade, so its auth message carries it; a second one is refused, and changes nothing."""
    hosted = KeyedUpstream("open", {"carol"})
    async with running(hosted.app()) as upstream_url:
        hosted.url = f"{upstream_url}/v1"
        targets = (UpstreamTarget(hosted.url, pass_client_key=True, models=("open",)),)
        engine = UpstreamEngine(UpstreamConfig(targets))
        start = {"type": "reply", "id": "t", "prompt": "hi"}
        async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{url}/v1/ws") as ws:
                await ws.send_json({"type": "auth", "api_key": "carol"})
                await ws.send_json(start)
                assert (await read_until_ended(ws, {"t"}))[-1]["type"] == "done"
                await ws.send_json({"type": "auth", "api_key": "mallory"})
                refused = await ws.receive_json()
                await ws.send_json({**start, "id": "u"})
                assert (await read_until_ended(ws, {"u"}))[-1]["type"] == "done"
    assert refused["type"] == "error" and refused["id"] is None
    assert refused["data"]["error"]["param"] == "api_key"
    assert hosted.requests() == ["Bearer carol", "Bearer carol"]


async def test_a_client_key_that_cannot_go_in_a_header_is_the_clients_401_and_opens_no_circuit():
    """A key of characters no HTTP header can carry (non-ASCII) is the caller's to fix: it
    is refused here in our words, tried nowhere, and the upstream stays in routing."""
    hosted = KeyedUpstream("open", {"alice"})
    async with running(hosted.app()) as upstream_url:
        hosted.url = f"{upstream_url}/v1"
        targets = (UpstreamTarget(hosted.url, pass_client_key=True, models=("open",)),)
        engine = UpstreamEngine(UpstreamConfig(targets, failures=1))
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        async with running(create_app(engine)) as url:
            for _ in range(3):  # more than --upstream-failures
                response = await raw_request(
                    f"{url}/v1/chat/completions",
                    "POST",
                    body,
                    {"Content-Type": "application/json", "Authorization": "Bearer ключ"},
                )
                error = json.loads(await response.read_body())["error"]
                assert response.status == 401, error
                assert error["code"] == "upstream_refused_client_key"
                assert "cannot be passed on" in error["message"] and "ключ" not in error["message"]
            assert await chat(url, "alice", "open") == "hello there"
        await engine.aclose()
    assert hosted.requests() == ["Bearer alice"]


class QuotaUpstream(KeyedUpstream):
    """A hosted API that bills per key: a key whose quota is spent gets 429, others a reply."""

    def __init__(self, model: str, keys: set[str], spent: set[str]) -> None:
        super().__init__(model, keys)
        self.spent = spent

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization", "").removeprefix("Bearer ") in self.spent:
            self.sent.append(request.headers.get("Authorization"))
            error = {"message": "You exceeded your current quota.", "type": "insufficient_quota"}
            return web.json_response({"error": error}, status=429)
        return await super().chat(request)


async def test_a_429_for_the_callers_own_key_is_the_callers_and_opens_no_circuit():
    """At an upstream that takes each caller's key, a 429 is that caller's quota or rate
    limit: it gets the 429 (no other upstream is tried), and other callers still get there."""
    hosted = QuotaUpstream("open", {"alice", "mallory"}, spent={"mallory"})
    async with running(hosted.app()) as upstream_url:
        hosted.url = f"{upstream_url}/v1"
        targets = (UpstreamTarget(hosted.url, pass_client_key=True, models=("open",)),)
        engine = UpstreamEngine(UpstreamConfig(targets, failures=1))
        async with running(create_app(engine)) as url:
            async with openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="mallory", max_retries=0
            ) as client:
                for _ in range(3):  # more than --upstream-failures
                    with pytest.raises(openai.RateLimitError) as caught:
                        await client.chat.completions.create(
                            model="open", messages=[{"role": "user", "content": "hi"}]
                        )
                    error = caught.value.body
                    assert isinstance(error, dict) and error["code"] == "upstream_rate_limited"
                    assert "exceeded your current quota" in error["message"]
            assert await chat(url, "alice", "open") == "hello there"
        await engine.aclose()
    assert hosted.requests() == ["Bearer mallory"] * 3 + ["Bearer alice"]
