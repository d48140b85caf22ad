"""An upstream's 404 to a chat request, over real aiohttp upstreams on loopback sockets and an
``UpstreamEngine`` served by replystream: a model that upstream does not serve (a typo in a
routes file's ``models``) is about that model there, not the upstream's health. The request
goes to another upstream serving the model; with none left, the client gets a 404 in its
dialect's shape; and the upstream's circuit stays closed for the models it does serve. Its 404
is remembered: later requests for that model go to the others first, until a probe lists the
model there again, and it is still asked when no other upstream is left."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.conftest import wait_for
from tests.sse_client import post_events
from tests.test_gateway import metric
from tests.test_upstream_routing import Upstream


class Serving(Upstream):
    """Serves the models in ``real`` and answers any other model 404, as vLLM does."""

    def __init__(self, real: list[str]) -> None:
        super().__init__(real)
        self.asked: list[str] = []
        self.listings: list[list[str]] = []  # the models each probe was answered with

    async def list_models(self, request: web.Request) -> web.Response:
        self.listings.append(list(self.models))
        return await super().list_models(request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        model = (await request.json())["model"]
        self.asked.append(model)
        if model not in self.models:
            error = {
                "message": f"The model `{model}` does not exist.",
                "type": "NotFoundError",
                "code": 404,
            }
            return web.json_response({"error": error}, status=404)
        return await super().chat(request)


@asynccontextmanager
async def relay(
    targets: list[tuple[Upstream, tuple[str, ...]]], **config: Any
) -> AsyncIterator[tuple[str, list[str]]]:
    """A relay in front of each upstream with the models its routes entry names (one failure
    opens a circuit, so a 404 counted as one would show at once): its URL and the upstreams'."""
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u, _ in targets]
        routes = UpstreamConfig(
            tuple(
                UpstreamTarget(f"{url}/v1", models=models)
                for url, (_, models) in zip(urls, targets, strict=True)
            ),
            failures=1,
            **config,
        )
        app = create_app(UpstreamEngine(routes))
        yield await stack.enter_async_context(running(app)), [f"{u}/v1" for u in urls]


def ask(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_a_model_one_upstream_does_not_serve_goes_to_another_and_leaves_its_circuit_closed():
    # The routes file says the first upstream serves "qwen" (a typo: it serves "qwen2").
    typo, other = Serving(["llama", "qwen2"]), Serving(["qwen"])
    async with relay([(typo, ("llama", "qwen")), (other, ("qwen",))]) as (url, upstreams):
        for _ in range(3):
            got = await post_events(f"{url}/v1/chat/completions", ask("qwen"))
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
        assert "qwen" in typo.asked and other.asked == ["qwen"] * 3
        # Its own models are still served there: the 404s opened no circuit.
        got = await post_events(f"{url}/v1/chat/completions", ask("llama"))
        assert got.status == 200 and got.chat_text == "w0 w1 w2 "
        assert typo.asked[-1] == "llama"
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
            metrics = await response.text()
        typo_url = upstreams[0]
    refused = typo.asked.count("qwen")
    assert refused >= 1
    counted = metric(
        metrics, "replystream_upstream_attempts", result="model_not_found", upstream=typo_url
    )
    assert counted == refused, metrics


async def test_a_model_no_upstream_serves_is_a_404_in_each_dialects_shape():
    typo = Serving(["llama"])
    async with relay([(typo, ("llama", "qwen"))]) as (url, _):
        chat = await post_events(f"{url}/v1/chat/completions", ask("qwen"))
        message = {"model": "qwen", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        claude = await post_events(f"{url}/v1/messages", message)
        after = await post_events(f"{url}/v1/chat/completions", ask("llama"))
    assert chat.status == 404
    error = json.loads(chat.raw)["error"]
    assert error["code"] == "model_not_found"
    assert "does not serve the model" in error["message"] and "`qwen`" in error["message"]
    assert claude.status == 404
    assert json.loads(claude.raw)["error"]["type"] == "not_found_error"
    assert after.status == 200 and after.chat_text == "w0 w1 w2 "


async def test_an_upstream_that_answered_404_for_a_model_is_not_asked_for_it_again():
    typo, other = Serving(["llama", "qwen2"]), Serving(["qwen"])
    async with relay([(typo, ("llama", "qwen")), (other, ("qwen",))]) as (url, _):
        for _ in range(6):
            got = await post_events(f"{url}/v1/chat/completions", ask("qwen"))
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
        got = await post_events(f"{url}/v1/chat/completions", ask("llama"))
        assert got.status == 200 and got.chat_text == "w0 w1 w2 "
    # One round trip to hear it does not serve "qwen", not one every other request; the
    # models it does serve still go there.
    assert typo.asked.count("qwen") == 1 and other.asked.count("qwen") == 6
    assert typo.asked[-1] == "llama"


async def test_a_probe_that_lists_the_model_again_sends_requests_for_it_there_again():
    typo, other = Serving(["llama", "qwen2"]), Serving(["qwen"])
    async with relay([(typo, ("llama", "qwen")), (other, ("qwen",))], health_s=1.0) as (url, _):
        for _ in range(2):
            got = await post_events(f"{url}/v1/chat/completions", ask("qwen"))
            assert got.status == 200
        assert typo.asked.count("qwen") == 1
        typo.models.append("qwen")  # loaded: its listing says so from now on
        # Two probes listed it: the first one's answer has been taken in (a round of
        # probes ends before the next begins).
        await wait_for(lambda: sum("qwen" in m for m in typo.listings) >= 2, timeout_s=15.0)
        for _ in range(4):
            got = await post_events(f"{url}/v1/chat/completions", ask("qwen"))
            assert got.status == 200 and got.chat_text == "w0 w1 w2 "
    assert typo.asked.count("qwen") >= 2  # sent there again, and served


async def test_an_upstream_that_answered_404_is_still_asked_when_no_other_is_left():
    typo, other = Serving(["llama", "qwen2"]), Serving(["qwen"])
    # No probe before the end (health_s): nothing but a request can find the model back.
    async with relay([(typo, ("llama", "qwen")), (other, ("qwen",))], health_s=60.0) as (url, _):
        for _ in range(2):
            got = await post_events(f"{url}/v1/chat/completions", ask("qwen"))
            assert got.status == 200
        assert typo.asked.count("qwen") == 1
        typo.models.append("qwen")  # loaded again, and no probe has said so
        other.mode = "busy"  # and the other upstream answers 503
        got = await post_events(f"{url}/v1/chat/completions", ask("qwen"))
        assert got.status == 200 and got.chat_text == "w0 w1 w2 "
    assert other.asked.count("qwen") == 3 and typo.asked.count("qwen") == 2


async def test_an_upstream_url_without_its_v1_is_said_and_failed_over_not_a_missing_model():
    """A base URL without its /v1: the server answers the chat request 404 with no word of a
    model (aiohttp's "404: Not Found" here; FastAPI's {"detail": "Not Found"}, nginx's page).
    Once told as "it does not serve the model sent to it" and never counted against it; now
    a 502 saying the path is missing, and another upstream is tried first."""
    right = Serving(["llama"])
    async with running(right.app()) as server:
        wrong = UpstreamTarget(server, models=("llama",))  # the same server, its /v1 left out
        alone = UpstreamEngine(UpstreamConfig((wrong,), model="llama"))
        async with running(create_app(alone)) as url:
            refused = await post_events(f"{url}/v1/chat/completions", ask("llama"))
        both = (wrong, UpstreamTarget(f"{server}/v1", models=("llama",)))
        async with running(create_app(UpstreamEngine(UpstreamConfig(both)))) as url:
            served = [await post_events(f"{url}/v1/chat/completions", ask("llama")) for _ in "ab"]
    assert refused.status == 502, refused.raw
    error = json.loads(refused.raw)["error"]
    assert error["code"] == "upstream_error_status", error
    assert error["message"] == (
        f"the upstream at {server} answered 404 to POST {server}/chat/completions: it has no "
        "such path; does its URL end in /v1?"
    ), error
    assert [got.status for got in served] == [200, 200], [got.raw for got in served]
