"""The relay's routing, credentials, usage and failover against small aiohttp upstreams in
this process (each a real server on a loopback port), with replystream serving an
``UpstreamEngine`` on another: model routes and aliases, each upstream's own key, the
upstream's own usage, per-key token counts, failover and its access-log lines, and a stall
that keep-alives do not hide."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.engine.upstream_routes import load_routes
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import wait_for
from tests.processes import StderrLines, launch, ready_url, replica, stop
from tests.rawhttp import raw_request
from tests.sse_client import post_events


def chunk(
    content: str | None = None, finish: str | None = None, legacy: bool = False, **extra: Any
) -> bytes:
    """A chat chunk, or with ``legacy`` a legacy completion's (its text, no delta)."""
    if legacy:
        choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
    else:
        delta = {} if content is None else {"content": content}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"choices": [choice], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


class Upstream:
    """An OpenAI-compatible upstream: lists ``models``, answers as ``mode`` says, its usage
    with ``usage``'s fields added (the prompt's details, say)."""

    def __init__(
        self,
        models: list[str],
        mode: str = "ok",
        words: int = 3,
        usage: dict[str, Any] | None = None,
    ) -> None:
        self.models, self.mode, self.words = models, mode, words
        self.usage = usage or {}
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.usage_unasked = True  # its usage even to a request without stream_options
        self.requested = asyncio.Event()  # set by the first request
        self.refusal: tuple[int, Any] = (400, {"error": {"message": "bad field"}})  # "refuse"

    async def list_models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``/chat/completions``, and ``/completions`` alike in legacy chunks."""
        legacy = not request.path.endswith("/chat/completions")
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        self.requested.set()
        if self.mode == "uuid_ids" and not is_uuid(request.headers.get("X-Request-Id", "")):
            # As llama-cpp-python's server (starlette-context) refuses an id not a UUID.
            return web.Response(status=400)
        if self.mode == "busy":
            return web.json_response({"error": {"message": "busy"}}, status=503)
        if self.mode == "empty_when_long" and len(json.dumps(self.bodies[-1])) > 500:
            # llama-cpp-python's server's answer to a streamed prompt past its context: a
            # head, and an empty body.
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            return response
        if self.mode == "refuse":  # the request itself: a 400, as vLLM's for a bad field
            status, body = self.refusal
            return web.json_response(body, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "slow":  # a head, then a long prefill
            await asyncio.sleep(0.8)
        if self.mode == "silent":  # a head, then nothing but keep-alives
            for _ in range(300):
                await response.write(b": keep-alive\n\n")
                await asyncio.sleep(0.05)
        if not legacy:
            await response.write(chunk("", role="assistant"))
        for i in range(self.words):
            await response.write(chunk(f"w{i} ", legacy=legacy))
        if self.mode == "cut":  # text, then the connection closes mid-body (a crash)
            assert request.transport is not None
            request.transport.close()
            return response
        if self.mode == "stall":  # text, then keep-alives only
            for _ in range(300):
                await response.write(b": keep-alive\n\n")
                await asyncio.sleep(0.05)
        await response.write(chunk(None, "stop", legacy=legacy))
        if self.usage_unasked or self.bodies[-1].get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 11, "completion_tokens": self.words, "total_tokens": 0}
            usage.update(self.usage)
            await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
            await response.write(b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.chat)
        return app


class Scripted(Upstream):
    """Streams ``pieces`` (whole SSE events, as written), then ``done`` (``[DONE]``)."""

    def __init__(self, pieces: Sequence[bytes], done: bytes = b"data: [DONE]\n\n") -> None:
        super().__init__(["m"])
        self.pieces = tuple(pieces)
        self.done = done

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in self.pieces:
            await response.write(piece)
        await response.write(self.done)
        return response


class ServesApp(Protocol):
    """A stand-in upstream: an aiohttp app to run on a loopback port."""

    def app(self) -> web.Application: ...


@asynccontextmanager
async def relay(
    upstreams: Sequence[ServesApp],
    keys: list[str | None] | None = None,
    server: ServerConfig | None = None,
    **config: Any,
) -> AsyncIterator[str]:
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in upstreams]
        keys = keys or [None] * len(urls)
        targets = tuple(
            UpstreamTarget(f"{u}/v1", api_key=k) for u, k in zip(urls, keys, strict=True)
        )
        engine = UpstreamEngine(UpstreamConfig(targets, **config))
        yield await stack.enter_async_context(running(create_app(engine, server)))


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def test_models_are_the_upstreams_own_merged_and_a_request_picks_the_ones_serving_it():
    a, b = Upstream(["llama"]), Upstream(["qwen", "mistral"])
    async with relay([a, b], aliases=(("gpt-4o-mini", "qwen"),)) as url:
        status, listing = await get_json(f"{url}/v1/models")
        assert status == 200
        assert [m["id"] for m in listing["data"]] == ["llama", "mistral", "qwen", "gpt-4o-mini"]
        for asked, sent, served_by in (
            ("qwen", "qwen", b),
            ("gpt-4o-mini", "qwen", b),
            ("llama", "llama", a),
            ("mistral", "mistral", b),
        ):
            body = {"model": asked, "messages": [{"role": "user", "content": "hi"}]}
            got = await post_events(f"{url}/v1/chat/completions", {**body, "stream": True})
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
            assert served_by.bodies[-1]["model"] == sent
            assert json.loads(got.events[0].data)["model"] == asked  # as the client named it
        status, one = await get_json(f"{url}/v1/models/mistral")
        assert status == 200 and one["id"] == "mistral"
        unknown = await post_events(
            f"{url}/v1/chat/completions",
            {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert unknown.status == 404
        assert json.loads(unknown.raw)["error"]["code"] == "model_not_found"
        # Anthropic's route routes by its model too.
        message = {
            "model": "llama",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}],
        }
        got = await post_events(f"{url}/v1/messages", message)
        assert got.status == 200 and a.bodies[-1]["model"] == "llama"
        # So does the native one, streamed or not, and a WebSocket's reply.
        for stream in (True, False):
            got = await post_events(
                f"{url}/v1/replies", {"model": "gpt-4o-mini", "prompt": "x", "stream": stream}
            )
            assert got.status == 200 and b.bodies[-1]["model"] == "qwen", got.raw
        native_unknown = await post_events(f"{url}/v1/replies", {"model": "gpt-5", "prompt": "x"})
        assert native_unknown.status == 404
        async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "r", "model": "llama", "prompt": "x"})
            while (await ws.receive_json(timeout=10))["type"] not in ("done", "error"):
                pass
        assert a.bodies[-1]["model"] == "llama"


CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_the_servers_own_name_of_a_real_model_routes_as_that_model():
    """--model-name names a model an upstream lists: a request for it, or for none, goes to
    the upstreams serving it (never to another model's, labelled as this one)."""
    alpha, beta = Upstream(["alpha"]), Upstream(["beta"])
    server = ServerConfig(model_name="alpha")
    async with relay([alpha, beta], server=server) as url:
        for body in [{**CHAT_HI, "model": "alpha"}] * 3 + [CHAT_HI] * 3:
            got = await post_events(f"{url}/v1/chat/completions", body)
            assert got.status == 200 and json.loads(got.events[0].data)["model"] == "alpha"
    assert len(alpha.bodies) == 6 and not beta.bodies
    assert {b["model"] for b in alpha.bodies} == {"alpha"}


async def test_a_request_for_no_model_sends_the_first_model_the_upstream_lists():
    """vLLM lists its base model first, LoRA adapters after it: the order is kept."""
    upstream = Upstream(["zeta", "alpha"])
    async with relay([upstream]) as url:
        got = await post_events(f"{url}/v1/chat/completions", CHAT_HI)
    assert got.status == 200 and upstream.bodies[-1]["model"] == "zeta"


async def test_a_request_for_no_model_is_answered_as_the_model_that_served_it():
    """With neither --model-name nor --upstream-model, a request for no model goes to the
    default (the first upstream's first model) and its reply names that model, in every
    dialect: never the engine's name ("upstream"), which no listing shows and is refused."""
    zeta, other = Upstream(["zeta", "alpha"]), Upstream(["beta"])
    async with relay([zeta, other]) as url:
        status, listing = await get_json(f"{url}/v1/models")
        assert status == 200
        assert [m["id"] for m in listing["data"]] == ["zeta", "alpha", "beta"]
        for _ in range(3):
            got = await post_events(f"{url}/v1/chat/completions", CHAT_HI)
            assert got.status == 200 and json.loads(got.events[0].data)["model"] == "zeta"
        whole = await post_events(f"{url}/v1/chat/completions", {**CHAT_HI, "stream": False})
        assert whole.status == 200 and json.loads(whole.raw)["model"] == "zeta"
        refused = await post_events(f"{url}/v1/chat/completions", {**CHAT_HI, "model": "upstream"})
        assert refused.status == 404, refused.raw
        assert json.loads(refused.raw)["error"]["code"] == "model_not_found"
    assert [b["model"] for b in zeta.bodies] == ["zeta"] * 4 and not other.bodies


async def test_time_between_tokens_counts_only_gaps_between_tokens():
    """The relay's last delta (the finish, the upstream's usage) carries no token: no gap is
    timed to it. Three words a reply: two gaps each."""
    async with relay([Upstream(["m"])]) as url:
        for _ in range(2):
            got = await post_events(f"{url}/v1/chat/completions", CHAT_HI)
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
            metrics = await response.text()
    endpoint = 'endpoint="/v1/chat/completions"'
    assert f"replystream_time_between_tokens_seconds_count{{{endpoint}}} 4.0" in metrics
    assert f"replystream_tokens_generated_total{{{endpoint}}} 6.0" in metrics


async def test_the_upstream_model_goes_only_to_upstreams_that_serve_it():
    """--upstream-model is what a request for no model is sent as: routed as that model,
    so never to an upstream that lists only others (it would answer 404)."""
    alpha, beta = Upstream(["alpha"]), Upstream(["beta"])
    async with relay([alpha, beta], model="beta") as url:
        for _ in range(4):
            got = await post_events(f"{url}/v1/chat/completions", CHAT_HI)
            assert got.status == 200
    assert not alpha.bodies and [b["model"] for b in beta.bodies] == ["beta"] * 4


async def test_the_upstream_model_names_the_replies_of_requests_for_none():
    """serve --upstream-model beta: a request for no model is sent as beta and answered as
    beta (not as "upstream", a name no upstream serves), and the models list names it."""
    beta = Upstream(["beta"])
    async with (
        running(beta.app()) as upstream,
        replica("--engine", f"upstream:{upstream}/v1", "--upstream-model", "beta") as (_, url),
    ):
        got = await post_events(f"{url}/v1/chat/completions", CHAT_HI)
        status, listing = await get_json(f"{url}/v1/models")
    assert got.status == 200 and beta.bodies[-1]["model"] == "beta"
    assert json.loads(got.events[0].data)["model"] == "beta"
    assert status == 200 and [m["id"] for m in listing["data"]] == ["beta"]


class Unlisted(Upstream):
    """An upstream without ``GET /models`` (404): its models are not known."""

    async def list_models(self, _: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "not found"}}, status=404)


async def test_with_no_upstreams_models_known_a_request_is_sent_the_model_it_names():
    """No upstream lists its models: the relay cannot tell a model from a typo, so it passes
    the name on as a plain relay would, and the upstream is the judge; a reply names it."""
    unlisted = Unlisted(["llama"])
    async with relay([unlisted]) as url:
        status, listing = await get_json(f"{url}/v1/models")
        assert status == 200 and [m["id"] for m in listing["data"]] == ["upstream"]
        for asked in ("llama", "qwen"):
            got = await post_events(f"{url}/v1/chat/completions", {**CHAT_HI, "model": asked})
            assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
            assert unlisted.bodies[-1]["model"] == asked
            assert json.loads(got.events[0].data)["model"] == asked


async def test_an_upstream_model_no_upstream_lists_is_said_at_start_and_to_each_request():
    """serve --upstream-model bta (a typo: the upstream lists beta): the server says so as it
    starts and at /healthz, and a request for no model gets a 404 naming both, not a 503
    that invites it to retry; a request naming beta is served, and only beta is listed."""
    beta = Upstream(["beta"])
    async with running(beta.app()) as upstream:
        process = await launch(
            "--engine", f"upstream:{upstream}/v1", "--upstream-model", "bta",
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            url = await ready_url(process)
            [said] = await StderrLines(process).wait_for("the engine is not ready")
            health_status, health = await get_json(f"{url}/healthz")
            got = await post_events(f"{url}/v1/chat/completions", CHAT_HI)
            named = await post_events(f"{url}/v1/chat/completions", {**CHAT_HI, "model": "beta"})
            models_status, listing = await get_json(f"{url}/v1/models")
        finally:
            await stop(process)
    unserved = "no upstream serves the model 'bta' (--upstream-model"
    assert unserved in said and "they serve 'beta'" in said, said
    assert health_status == 503 and unserved in health["reason"], health
    assert got.status == 404, got.raw
    error = json.loads(got.raw)["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert unserved in error["message"] and "they serve 'beta'" in error["message"], error
    assert named.status == 200 and named.chat_text == "w0 w1 w2 "
    assert [body["model"] for body in beta.bodies] == ["beta"]
    # Listed are the models a request may be served: not the typo.
    assert models_status == 200 and [m["id"] for m in listing["data"]] == ["beta"], listing


async def test_an_upstream_model_no_upstream_lists_is_not_listed_and_still_refused_by_name():
    """--upstream-model m9 (a typo) while the upstreams list m1 and m3: /v1/models lists
    what a request may be served, so not m9; a request for no model, or for m9, is still
    the 404 that names the option (not sent to m1 instead); one for m3 is served."""
    async with relay([Upstream(["m1"]), Upstream(["m3"])], model="m9") as url:
        status, listing = await get_json(f"{url}/v1/models")
        assert status == 200 and [m["id"] for m in listing["data"]] == ["m1", "m3"]
        one_status, _ = await get_json(f"{url}/v1/models/m9")
        assert one_status == 404
        for body in (CHAT_HI, {**CHAT_HI, "model": "m9"}):
            got = await post_events(f"{url}/v1/chat/completions", body)
            assert got.status == 404, got.raw
            message = json.loads(got.raw)["error"]["message"]
            assert "no upstream serves the model 'm9' (--upstream-model" in message, message
        served = await post_events(f"{url}/v1/chat/completions", {**CHAT_HI, "model": "m3"})
        assert served.status == 200 and served.chat_text == "w0 w1 w2 "
    async with relay([Upstream(["m1"]), Upstream(["m3"])], model="m3") as url:
        status, listing = await get_json(f"{url}/v1/models")
        assert [m["id"] for m in listing["data"]] == ["m3", "m1"]  # served: the default first


class ListsLater(Upstream):
    """Answers its ``/models`` 503 until ``listing`` is set (an upstream still starting)."""

    listing = False

    async def list_models(self, request: web.Request) -> web.Response:
        if not self.listing:
            return web.json_response({"error": {"message": "loading"}}, status=503)
        return await super().list_models(request)


async def test_an_upstream_model_found_unserved_after_start_up_is_said_once(caplog):
    """The upstreams' lists are learned only after start-up (none answered its first probe):
    once they are, and none lists --upstream-model, the log says so once, naming the option,
    however many probes follow."""
    later = ListsLater(["m1"])
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    async with relay([later], model="m9", health_s=0.1) as url:
        _, listing = await get_json(f"{url}/v1/models")
        assert [m["id"] for m in listing["data"]] == ["m9"]  # nothing known yet: maybe served
        later.listing = True

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "--upstream-model" in r.getMessage()]

        await wait_for(lambda: bool(said()), timeout_s=10.0)
        await asyncio.sleep(0.5)  # several more rounds of probes
        _, listing = await get_json(f"{url}/v1/models")
        assert [m["id"] for m in listing["data"]] == ["m1"]
    [warning] = said()
    assert warning.startswith("no upstream serves the model 'm9' (--upstream-model"), warning
    assert "they serve 'm1'" in warning and "/healthz answers 503" in warning


async def test_an_alias_for_a_model_no_upstream_lists_is_not_served():
    """Every upstream listed its models and none lists the one an alias stands for: the
    alias is a name nobody serves, as the model's own name is (not listed, a 404), not an
    overload to retry."""
    async with relay([Upstream(["llama"])], aliases=(("gone", "qwen"), ("fast", "llama"))) as url:
        status, listing = await get_json(f"{url}/v1/models")
        assert status == 200 and [m["id"] for m in listing["data"]] == ["llama", "fast"]
        for asked in ("gone", "qwen"):
            body: dict[str, Any] = {"model": asked, "messages": [{"role": "user", "content": "hi"}]}
            got = await post_events(f"{url}/v1/chat/completions", body)
            assert got.status == 404, got.raw
            assert json.loads(got.raw)["error"]["code"] == "model_not_found"
        body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        got = await post_events(f"{url}/v1/chat/completions", body)
        assert got.status == 200 and got.chat_text == "w0 w1 w2 "


async def test_each_upstream_gets_its_own_key_and_never_the_clients():
    a, b = Upstream(["m"]), Upstream(["m"])
    server = ServerConfig(api_keys=("client-key",))
    async with relay([a, b], keys=["a-key", None], server=server, api_key="shared") as url:
        auth = {"Authorization": "Bearer client-key"}
        for seed in range(4):
            body = {"prompt": "hi", "seed": seed, "stream": False}
            got = await post_events(f"{url}/v1/replies", body, auth)
            assert got.status == 200
    sent = {h["Authorization"] for h in a.headers} | {h["Authorization"] for h in b.headers}
    assert sent == {"Bearer a-key", "Bearer shared"}
    assert {h["Authorization"] for h in a.headers} == {"Bearer a-key"}


async def test_usage_is_the_upstreams_own_and_shown_only_when_asked():
    up = Upstream(["m"])
    async with relay([up]) as url:
        chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        plain = await post_events(f"{url}/v1/chat/completions", chat)
        assert up.bodies[-1]["stream_options"] == {"include_usage": True}  # asked upstream
        assert all("usage" not in json.loads(e.data) for e in plain.events if e.data != "[DONE]")
        asked = await post_events(
            f"{url}/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}
        )
        usage = json.loads(asked.events[-2].data)["usage"]
        assert usage == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
        native = await post_events(f"{url}/v1/replies", {"prompt": "hi", "stream": False})
        assert json.loads(native.raw)["usage"]["prompt_tokens"] == 11


async def test_tokens_are_counted_per_key_for_finished_and_cancelled_replies():
    up = Upstream(["m"], mode="stall")
    server = ServerConfig(api_keys=("k1",))
    async with relay([up], server=server, stall_s=30) as url:
        auth = {"Authorization": "Bearer k1"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/replies", json={"prompt": "hi"}, headers=auth) as response,
        ):
            seen = b""
            while seen.count(b"event: token") < 3:
                seen += await response.content.readany()
        # The client left mid-reply: the reply is cancelled, its tokens still counted.
        label = hashlib.sha256(b"k1").hexdigest()[:12]
        series = f'replystream_key_tokens_total{{key="{label}",kind="completion"}} 3.0'
        async with asyncio.timeout(10):
            while True:
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"{url}/metrics") as response,
                ):
                    text = await response.text()
                if series in text:
                    break
                await asyncio.sleep(0.05)
        assert f'replystream_key_tokens_total{{key="{label}",kind="prompt"}} 1.0' in text
        assert "k1" not in text.replace(label, "")


async def test_a_refusing_upstream_fails_over_and_the_access_log_says_so(caplog):
    busy, ok = Upstream(["m"], mode="busy"), Upstream(["m"])
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with relay([busy, ok]) as url:
        for seed in range(4):
            got = await post_events(
                f"{url}/v1/replies",
                {"prompt": "hi", "seed": seed, "stream": False},
                {"X-Request-Id": f"req-{seed}"},
            )
            assert got.status == 200 and json.loads(got.raw)["text"] == "w0 w1 w2 "
    lines = [json.loads(r.getMessage()) for r in caplog.records if '"attempt"' in r.getMessage()]
    refused = [line for line in lines if line["result"] == "overloaded"]
    assert refused and all(line["request_id"].startswith("req-") for line in refused)
    assert len(busy.bodies) >= 1 and len(ok.bodies) == 4


async def test_the_warning_of_a_request_no_upstream_answered_names_its_request(caplog):
    # The server log's line for it, at WARNING, is found by the id its client, its
    # access-log line and its attempts' lines have.
    caplog.set_level(logging.WARNING, logger="replystream.server")
    async with relay([Upstream(["m"], mode="busy")]) as url:
        got = await post_events(
            f"{url}/v1/replies",
            {"prompt": "hi", "stream": False},
            {"X-Request-Id": "req-told"},
        )
    assert got.status == 503, got.raw
    said = [r.getMessage() for r in caplog.records if "failed before its answer" in r.getMessage()]
    assert said and all(line.startswith("request req-told: ") for line in said), said


async def test_asking_an_upstream_for_logprobs_it_lacks_does_not_open_its_circuit():
    """An upstream without log probabilities answers such a request with text alone: the
    request's wish, not the upstream's sickness, so other requests still go there."""
    up = Upstream(["m"])
    ask = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with relay([up], failures=1) as url:
        for _ in range(3):  # more than --upstream-failures
            got = await post_events(f"{url}/v1/chat/completions", {**ask, "logprobs": True})
            assert got.status == 200
            assert [e["error"]["code"] for e in got.of_type("error")] == ["upstream_no_logprobs"]
        got = await post_events(f"{url}/v1/chat/completions", ask)
        assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
    assert len(up.bodies) == 4


async def test_an_empty_stream_for_a_long_prompt_does_not_open_the_upstreams_circuit():
    """A streamed body that ends with no output at all may be the request's fault (a prompt
    past the upstream's context, as llama-cpp-python answers one): any client's long prompts
    must not take the upstream out of routing for every other request."""
    up = Upstream(["m"], mode="empty_when_long")
    long = {"messages": [{"role": "user", "content": "hello " * 200}], "stream": True}
    async with relay([up], failures=1) as url:
        for _ in range(3):  # more than --upstream-failures
            got = await post_events(f"{url}/v1/chat/completions", long)
            [error] = [e["error"] for e in got.of_type("error")]
            assert error["code"] == "upstream_empty"
            # Both of llama-cpp-python's reasons for it are named: a prompt past its context,
            # and a tool choice its chatml-function-calling format does not stream.
            assert "for a prompt past its context" in error["message"]
            assert "tool_choice of auto or required" in error["message"]
        short = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        got = await post_events(f"{url}/v1/chat/completions", short)
        assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
        status, health = await get_json(f"{url}/healthz")
    assert status == 200, health
    assert len(up.bodies) == 4


async def test_no_text_before_the_ttft_limit_fails_over_and_all_failing_is_the_last_error():
    silent, ok = Upstream(["m"], mode="silent"), Upstream(["m"])
    async with relay([silent, ok], ttft_s=0.3) as url:
        for seed in range(3):
            got = await post_events(f"{url}/v1/replies", {"prompt": "hi", "seed": seed})
            assert got.text == "w0 w1 w2 " and got.types[-1] == "done"
    async with relay([Upstream(["m"], mode="busy")] * 1) as url:
        got = await post_events(
            f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        )
        assert got.status == 503
        error = json.loads(got.raw)["error"]
        assert error["code"] == "upstream_overloaded" and "aiohttp" not in error["message"]


async def test_an_upstream_that_fails_every_reply_mid_way_opens_its_circuit():
    """Its first text does not end a row of failures: each reply that then breaks is one
    more, so an upstream that never finishes a reply is taken out of routing."""
    cut = Upstream(["m"], mode="cut")
    ask = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with relay([cut], failures=2) as url:
        for _ in range(2):
            got = await post_events(f"{url}/v1/chat/completions", ask)
            assert got.chat_text == "w0 w1 w2 "
            assert [e["error"]["code"] for e in got.of_type("error")] == ["upstream_disconnected"]
        got = await post_events(f"{url}/v1/chat/completions", ask)
        assert got.status == 503, got.raw
        assert json.loads(got.raw)["error"]["code"] == "upstream_unavailable"
    assert len(cut.bodies) == 2


async def test_keepalives_do_not_hide_a_stall_mid_reply():
    up = Upstream(["m"], mode="stall")
    async with relay([up], stall_s=0.4) as url:
        got = await post_events(f"{url}/v1/replies", {"prompt": "hi"})
    assert got.text == "w0 w1 w2 "
    errors = got.of_type("error")
    assert [e["error"]["code"] for e in errors] == ["upstream_stalled"]
    assert "sent no text for 0.4 s mid-reply" in errors[0]["error"]["message"]


@pytest.mark.parametrize("continuation", [True, False])
async def test_a_stall_continues_at_another_upstream_only_when_allowed(continuation: bool):
    stalling, other = Upstream(["m"], mode="stall"), Upstream(["m"], words=5)
    async with relay([stalling, other], stall_s=0.4) as url:
        body = {"prompt": "hi", "upstream_continue": continuation}
        got = await post_events(f"{url}/v1/replies", body)
    if not continuation:
        assert got.types[-1] == "error" and other.bodies == []
        return
    assert got.types.count("continued") == 1 and got.types[-1] == "done"
    assert got.of_type("continued")[0] == {"reason": "upstream_stalled", "after_tokens": 3}
    sent = other.bodies[0]
    assert sent["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2 "}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    # This fake upstream does not continue: it starts over, and the client reads what it sent.
    assert got.text == "w0 w1 w2 " + "w0 w1 w2 w3 w4 "


async def test_text_batched_before_a_seam_goes_out_before_the_continued_event():
    """Batching holds the first upstream's text when it dies: that text is sent before the
    ``continued`` event, which says where the next upstream's text begins."""
    cut, other = Upstream(["m"], mode="cut"), Upstream(["m"], words=5)
    async with relay([cut, other]) as url:
        body = {"prompt": "hi", "upstream_continue": True, "batch_tokens": 4, "batch_ms": 5000}
        got = await post_events(f"{url}/v1/replies", body)
    assert got.types[-1] == "done" and got.types.count("continued") == 1
    seam = got.types.index("continued")
    before = "".join(json.loads(e.data)["text"] for e in got.events[:seam] if e.type == "token")
    assert before == "w0 w1 w2 "
    assert got.of_type("continued")[0] == {"reason": "upstream_disconnected", "after_tokens": 3}
    ids = [int(e.id) for e in got.events]
    assert ids == list(range(1, len(ids) + 1))


async def test_each_attempts_access_log_line_counts_the_tokens_it_relayed_itself(caplog):
    """After a continuation the reply's tokens are both upstreams', but each attempt's line
    says what that attempt relayed, as its ``ms`` is its own time."""
    stalling, other = Upstream(["m"], mode="stall"), Upstream(["m"], words=5)
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with relay([stalling, other], stall_s=0.4) as url:
        body = {"prompt": "hi", "upstream_continue": True}
        got = await post_events(f"{url}/v1/replies", body)
    assert got.types.count("continued") == 1 and got.types[-1] == "done"
    lines = [json.loads(r.getMessage()) for r in caplog.records if '"attempt"' in r.getMessage()]
    assert [(line["attempt"], line["result"], line["relayed_tokens"]) for line in lines] == [
        (1, "stalled", 3),
        (2, "ok", 5),
    ]


async def test_every_route_says_a_relay_failure_in_its_own_dialect_and_our_words():
    async with relay([Upstream(["m"], mode="busy")]) as url:
        claude = await post_events(
            f"{url}/v1/messages",
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        )
        responses = await post_events(f"{url}/v1/responses", {"input": "x", "stream": True})
        native = await post_events(f"{url}/v1/replies", {"prompt": "x"})
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as sdk:
            with pytest.raises(anthropic.OverloadedError):  # Anthropic's 529
                await sdk.messages.create(
                    model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
                )
    body = json.loads(claude.raw)
    assert claude.status == 529 and body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    for got in (responses, native):
        assert got.status == 503
        assert json.loads(got.raw)["error"]["code"] == "upstream_overloaded"
    for got in (claude, responses, native):
        message = json.loads(got.raw)["error"]["message"]
        assert message.startswith("the upstream at http://127.0.0.1:")
        assert not any(word in message for word in ("aiohttp", "Error", "Exception", "<"))


async def test_every_route_reports_the_upstreams_own_prompt_count_streamed_or_whole():
    """The upstream counts 11 prompt tokens; our estimate of "hi" is fewer. Anthropic's
    ``message_start`` goes out before the upstream's usage, so its ``message_delta`` carries
    the real count, which the SDK's final message takes; every other route sends usage at
    the end, and every one sends the upstream's."""
    up = Upstream(["m"])
    ask = [{"role": "user", "content": "hi"}]
    async with (
        relay([up]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        async with claude.messages.stream(model="m", max_tokens=9, messages=ask) as stream:  # type: ignore[arg-type]
            events = [event async for event in stream]
            final = await stream.get_final_message()
        whole = await claude.messages.create(model="m", max_tokens=9, messages=ask)  # type: ignore[arg-type]
        started = next(e for e in events if e.type == "message_start")
        delta = next(e for e in events if e.type == "message_delta")
        assert started.message.usage.input_tokens < 11  # an estimate: nothing else known yet
        assert (delta.usage.input_tokens, delta.usage.output_tokens) == (11, 3)
        assert (final.usage.input_tokens, final.usage.output_tokens) == (11, 3)
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (11, 3)

        response = await oai.responses.create(model="m", input="hi")
        streamed = await oai.responses.create(model="m", input="hi", stream=True)
        ends = [e.response async for e in streamed if e.type == "response.completed"]
        assert len(ends) == 1
        completed = ends[0]
        stored = await oai.responses.retrieve(completed.id)
        for got in (response, completed, stored):
            assert got.usage is not None
            assert (got.usage.input_tokens, got.usage.output_tokens) == (11, 3)

        chat = await oai.chat.completions.create(model="m", messages=ask)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.prompt_tokens == 11
        chunks = await oai.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=ask, stream=True, stream_options={"include_usage": True}
        )
        usage = [c.usage async for c in chunks if c.usage is not None]
        assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [(11, 3)]


class Unlistable(Upstream):
    """Serves chat, but its ``/models`` answer is one no listing can come from: JSON nested
    past any parser's depth, or a body past the size a listing is read to."""

    def __init__(self, body: bytes) -> None:
        super().__init__(["hidden"])
        self.body = body

    async def list_models(self, _: web.Request) -> web.Response:
        return web.Response(body=self.body, content_type="application/json")


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"data": [' + b'{"id": "m"},' * 600_000 + b"{}]}"],
    ids=["nested", "huge"],
)
async def test_a_models_answer_no_listing_can_come_from_leaves_the_upstream_serving(
    body: bytes, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING)
    odd, plain = Unlistable(body), Upstream(["llama"])
    async with relay([odd, plain]) as url:
        status, listing = await get_json(f"{url}/v1/models")
        assert status == 200
        assert [m["id"] for m in listing["data"]] == ["llama"]  # nothing read from the odd one
        status, health = await get_json(f"{url}/healthz")
        assert status == 200, health
        ask = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(2):  # no model named: any upstream, the odd one too
            got = await post_events(f"{url}/v1/chat/completions", ask)
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
    assert odd.bodies and plain.bodies
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


async def test_rerouting_keeps_a_staying_upstreams_state_and_probes_a_new_one_first():
    a, b, c = Upstream(["m"]), Upstream(["m"]), Upstream(["n"])
    probed_with: list[str | None] = []
    listing = c.list_models

    async def list_models(request: web.Request) -> web.Response:
        probed_with.append(request.headers.get("Authorization"))
        return await listing(request)

    c.list_models = list_models  # type: ignore[method-assign, assignment]
    async with AsyncExitStack() as stack:
        a_url, b_url, c_url = [await stack.enter_async_context(running(u.app())) for u in (a, b, c)]
        first = UpstreamConfig(
            (
                UpstreamTarget(f"{a_url}/v1", api_key="a-key", models=("m", "gone")),
                UpstreamTarget(f"{b_url}/v1"),
            )
        )
        engine = UpstreamEngine(first)
        url = await stack.enter_async_context(running(create_app(engine)))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(2):
            assert (await post_events(f"{url}/v1/chat/completions", body)).status == 200
        kept = engine.pool.backends[0]
        assert kept.attempts["ok"] == 1 and engine.pool.backends[1].attempts["ok"] == 1

        assert engine.stats().models == ("m", "gone")  # a's first model first: the default
        # a stays with a new key and weight, its models no longer given (its own list is
        # asked for); b leaves; c joins, its models not given.
        change = await engine.reroute(
            UpstreamConfig(
                (
                    UpstreamTarget(f"{a_url}/v1", weight=2, api_key="a-key-2"),
                    UpstreamTarget(f"{c_url}/v1", api_key="c-key"),
                )
            )
        )
        assert change.added == (f"{c_url}/v1",) and change.removed == (f"{b_url}/v1",)
        assert engine.pool.backends[0] is kept and kept.weight == 2 and kept.attempts["ok"] == 1
        assert kept.models == ("m",) and not kept.fixed_models
        joined = engine.pool.backends[1]
        # Probed before it took a request, with its own key: its model list is known.
        assert joined.probe_ok is True and joined.models == ("n",)
        assert probed_with == ["Bearer c-key"]
        assert engine.stats().models == ("m", "n")
        sent_to_b = len(b.bodies)
        for _ in range(3):
            assert (await post_events(f"{url}/v1/chat/completions", body)).status == 200
        body["model"] = "n"
        assert (await post_events(f"{url}/v1/chat/completions", body)).status == 200
        assert len(b.bodies) == sent_to_b  # nothing new for the upstream taken out
        assert [h["Authorization"] for h in a.headers[-3:]] == ["Bearer a-key-2"] * 3
        assert c.headers[-1]["Authorization"] == "Bearer c-key"
        assert [b.name for b in engine.stats().backends] == [f"{a_url}/v1", f"{c_url}/v1"]


def lowered(headers: dict[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


async def test_each_attempt_carries_the_request_id_and_the_callers_trace_context():
    busy, fine = Upstream(["m"], mode="busy"), Upstream(["m"])
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with relay([busy, fine]) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        sent = {"X-Request-Id": "req-42", "traceparent": parent, "tracestate": "vendor=abc"}
        got = await post_events(f"{url}/v1/chat/completions", body, sent)
        assert got.status == 200 and got.chat_text == "w0 w1 w2 "
        # Both attempts (the failover too) under the one id our access log names it by.
        for seen in map(lowered, (busy.headers[-1], fine.headers[-1])):
            assert seen["x-request-id"] == "req-42"
            assert (seen["traceparent"], seen["tracestate"]) == (parent, "vendor=abc")
        # No id given: ours; a trace context that is not one goes nowhere, its state neither.
        for bad in ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", "garbage", parent.upper()):
            headers = {"traceparent": bad, "tracestate": "vendor=abc"}
            got = await post_events(f"{url}/v1/chat/completions", body, headers)
            assert got.status == 200
            seen = lowered(fine.headers[-1])  # every reply ends there: the other is busy
            assert seen["x-request-id"] == lowered(got.headers)["x-request-id"] != "req-42"
            assert "traceparent" not in seen and "tracestate" not in seen, (bad, seen)
        # A later version's tail is left out, whatever it holds: one no header can carry
        # upstream failed the request before it left, and counted it on the upstream's circuit.
        later = parent.replace("00-", "01-", 1) + "-\u4e2d"
        for _ in range(4):
            chunks = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
            got_raw = await raw_request(
                f"{url}/v1/chat/completions", "POST", chunks, {"traceparent": later}
            )
            assert got_raw.status == 200, await got_raw.read_body()
            await got_raw.read_body()
            assert lowered(fine.headers[-1])["traceparent"] == parent


async def test_two_traceparent_fields_are_no_trace_and_tracestate_fields_are_one_list():
    """W3C Trace Context: a request with two ``traceparent`` fields has no parent to pass on
    (its upstream starts a trace of its own, as the standard's test suite expects), and the
    fields of ``tracestate`` are one list, joined as HTTP joins a list's fields."""
    fine = Upstream(["m"])
    one = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def send(*headers: tuple[str, str]) -> dict[str, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, json=body, headers=CIMultiDict(headers)) as response,
        ):
            assert response.status == 200
            await response.read()
        return lowered(fine.headers[-1])

    async with relay([fine]) as base:
        url = f"{base}/v1/chat/completions"
        seen = await send(("traceparent", one), ("traceparent", other), ("tracestate", "a=1"))
        assert "traceparent" not in seen and "tracestate" not in seen, seen
        seen = await send(("traceparent", one), ("traceparent", one))
        assert "traceparent" not in seen, seen
        seen = await send(("traceparent", one), ("tracestate", "a=1"), ("tracestate", "b=2"))
        assert (seen["traceparent"], seen["tracestate"]) == (one, "a=1,b=2")


async def test_a_later_versions_traceparent_goes_on_with_only_its_sampled_flag():
    """W3C Trace Context: of a later version's ``traceparent`` only the ids and the
    ``sampled`` flag are read; the version 00 it is passed on as has every other flag 0."""
    fine = Upstream(["m"])
    ids = "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with relay([fine]) as url:
        for flags, passed in (("ff", "01"), ("fe", "00"), ("01", "01")):
            headers = {"traceparent": f"cc-{ids}-{flags}-what-the-future-will-be-like"}
            assert (await post_events(f"{url}/v1/chat/completions", body, headers)).status == 200
            assert lowered(fine.headers[-1])["traceparent"] == f"00-{ids}-{passed}"


async def test_a_tracestate_with_tabs_around_its_members_goes_on_and_one_broken_does_not():
    """W3C Trace Context: spaces and tabs may surround ``tracestate``'s members (its test
    suite sends ``foo=1 \\t , \\t bar=2``), and a list not of its grammar is dropped, the
    ``traceparent`` beside it going on alone."""
    fine = Upstream(["m"])
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with relay([fine]) as url:
        for state, passed in (
            ("foo=1 \t , \t bar=2, \t baz=3", "foo=1,bar=2,baz=3"),
            ("foo=1,foo=2", None),
            ("FOO=1", None),
        ):
            headers = {"traceparent": parent, "tracestate": state}
            assert (await post_events(f"{url}/v1/chat/completions", body, headers)).status == 200
            seen = lowered(fine.headers[-1])
            assert seen["traceparent"] == parent and seen.get("tracestate") == passed, seen


async def test_a_request_id_of_ours_is_one_an_upstream_that_wants_uuids_takes():
    """Some servers (llama-cpp-python's) refuse a request whose ``X-Request-Id`` is not a
    UUID, with an empty 400: the ids this server makes for requests are UUIDs, so the
    requests of clients that send none (the SDKs) are relayed, under the id the client is
    told."""
    strict = Upstream(["m"], mode="uuid_ids")
    async with relay([strict]) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(3):
            got = await post_events(f"{url}/v1/chat/completions", body)
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
            sent = lowered(strict.headers[-1])["x-request-id"]
            assert sent == lowered(got.headers)["x-request-id"] and is_uuid(sent)


async def test_a_failover_leaves_the_round_robin_where_the_other_requests_find_it():
    """Two upstreams taking turns, one answering busy every time (its circuit kept closed):
    a request that began there moves on to the other, and the next request still begins at
    the other, its turn, rather than at the busy one again."""
    busy, fine = Upstream(["m"], mode="busy"), Upstream(["m"])
    async with relay([busy, fine], failures=100) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(6):
            got = await post_events(f"{url}/v1/chat/completions", body)
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
    # Every other request begins at the busy one (and fails over), not every request.
    assert (len(busy.bodies), len(fine.bodies)) == (3, 6)


async def test_an_upstreams_own_time_limits_replace_the_relays_for_it():
    silent, stalling, ok = (
        Upstream(["m"], mode="silent"),
        Upstream(["m"], mode="stall"),
        Upstream(["m"]),
    )
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in (silent, stalling, ok)]
        engine = UpstreamEngine(
            UpstreamConfig(
                (
                    UpstreamTarget(f"{urls[0]}/v1", ttft_s=0.3),
                    UpstreamTarget(f"{urls[1]}/v1", stall_s=0.3),
                    UpstreamTarget(f"{urls[2]}/v1", weight=1),
                ),
                ttft_s=30.0,
                stall_s=30.0,
            )
        )
        url = await stack.enter_async_context(running(create_app(engine)))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        for _ in range(6):  # each upstream goes first twice (ties go round)
            got = await post_events(f"{url}/v1/chat/completions", body)
            errors = [e["error"] for e in got.of_type("error")]
            if errors:  # the stalling one, given up on after its own 0.3 s, not the 30
                assert errors[0]["code"] == "upstream_stalled"
                assert "sent no text for 0.3 s mid-reply" in errors[0]["message"]
            else:  # the silent one left after its own 0.3 s for the next
                assert got.chat_text == "w0 w1 w2 "
        attempts = {b.name: dict(b.attempts) for b in engine.pool.backends}
        assert attempts[f"{urls[0]}/v1"].get("ttft_timeout", 0) >= 1
        assert attempts[f"{urls[1]}/v1"].get("stalled", 0) >= 1


def test_an_upstreams_own_first_text_limit_must_fit_in_the_failover_window():
    with pytest.raises(ValueError, match="past the failover window"):
        UpstreamConfig((UpstreamTarget("http://a/v1", ttft_s=90.0),), failover_s=60.0)


async def test_an_upstream_taken_out_and_put_back_counts_on_from_its_counts():
    """Its per-upstream rows are counts since start: put back, it does not start again at 0
    (a scrape would read a reset, and with workers the rows of every worker would differ)."""
    a, b = Upstream(["m"]), Upstream(["m"])
    async with AsyncExitStack() as stack:
        a_url, b_url = [await stack.enter_async_context(running(u.app())) for u in (a, b)]
        both = UpstreamConfig((UpstreamTarget(f"{a_url}/v1"), UpstreamTarget(f"{b_url}/v1")))
        engine = UpstreamEngine(both)
        url = await stack.enter_async_context(running(create_app(engine)))
        for _ in range(4):
            assert (await post_events(f"{url}/v1/chat/completions", CHAT_HI)).status == 200
        name = f"{a_url}/v1"

        def a_counts() -> tuple[int, int]:
            row = next(s for s in engine.stats().backends if s.name == name)
            return dict(row.attempts).get("ok", 0), sum(dict(row.probes).values())

        sent, probed = a_counts()
        assert sent == len(a.bodies) > 0 and probed > 0
        await engine.reroute(UpstreamConfig((UpstreamTarget(f"{b_url}/v1"),)))
        await engine.reroute(both)
        again, probed_again = a_counts()
        assert again == sent and probed_again > probed  # probed again before it rejoined
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
            metrics = await response.text()
        row = f'replystream_upstream_attempts{{result="ok",upstream="{name}"}} {float(sent)}'
        assert row in metrics, [r for r in metrics.splitlines() if "upstream_attempts{" in r]


async def test_a_routes_files_headers_go_with_every_request_and_probe_and_are_never_repeated(
    tmp_path: Path,
):
    """An identity-aware proxy in front of a model server wants headers of its own on every
    request (Cloudflare Access's client id and secret, say): a routes file's ``headers``
    and ``headers_env`` send them with relayed requests and health probes alike, and an
    upstream that repeats a secret one in its words has it withheld, as a key is."""
    secret = "cf-secret-0123456789"
    seen: dict[str, list[dict[str, str]]] = {"probe": [], "chat": []}

    async def models(request: web.Request) -> web.Response:
        seen["probe"].append(dict(request.headers))
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def chat(request: web.Request) -> web.Response:
        seen["chat"].append(dict(request.headers))
        said = f"the secret {request.headers.get('CF-Access-Client-Secret')} is expired"
        return web.json_response({"error": {"message": said}}, status=400)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    async with running(app) as upstream:
        path = tmp_path / "routes.toml"
        path.write_text(
            f'[[upstreams]]\nurl = "{upstream}/v1"\nheaders = {{ "X-Tenant" = "support" }}\n'
            'headers_env = { "CF-Access-Client-Secret" = "CF_SECRET" }\n'
        )
        routes = load_routes(path, env={"CF_SECRET": secret})
        engine = UpstreamEngine(UpstreamConfig(routes.targets))
        async with running(create_app(engine)) as url:
            ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            answer = await post_events(f"{url}/v1/chat/completions", ask)
    assert seen["probe"] and seen["chat"]
    for headers in (seen["probe"][0], seen["chat"][0]):
        assert headers["X-Tenant"] == "support", headers
        assert headers["CF-Access-Client-Secret"] == secret, headers
    assert answer.status == 400, answer.raw
    message = json.loads(answer.raw)["error"]["message"]
    assert secret not in message and "the secret (key withheld) is expired" in message, message


async def test_a_model_whose_id_holds_a_slash_is_retrieved_by_its_path():
    """Hugging Face names (``org/model``): the SDK sends the slash encoded, a plain client
    as it is; both reach the model (the latter was a 404 ``not_found``)."""
    async with relay([Upstream(["org/mod-1"])]) as url:
        for path in ("org/mod-1", "org%2Fmod-1"):
            status, one = await get_json(f"{url}/v1/models/{path}")
            assert (status, one.get("id")) == (200, "org/mod-1"), (path, one)
        status, missing = await get_json(f"{url}/v1/models/org/other")
    assert status == 404 and missing["error"]["code"] == "model_not_found"
