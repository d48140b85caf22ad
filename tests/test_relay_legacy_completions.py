"""A legacy completion (``POST /v1/completions``) relayed as one: to the upstream's own
``/completions`` with its prompt as written (a base model, a code model's fill-in markup, with
no chat template around it), against small aiohttp upstreams on loopback ports, replystream
serving an ``UpstreamEngine`` on another, and the official OpenAI SDK as the client.
Its fields, its log probabilities in the legacy shape, continuation after a cut (the prompt
extended by the text so far), and an upstream that serves chat alone."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
from aiohttp import web

from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, relay

FIM = "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n<|fim_middle|>"


def legacy_chunk(text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    body = {"id": "cmpl-1", "object": "text_completion", "model": "base", "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def legacy_logprobs(token: str, logprob: float) -> dict[str, Any]:
    alternative = {token: logprob, "zz": logprob - 2.0}
    return {
        "tokens": [token],
        "token_logprobs": [logprob],
        "top_logprobs": [alternative],
        "text_offset": [0],
    }


class BaseModelServer:
    """A base model's server: ``/v1/completions`` only (chat needs a template it lacks),
    answering ``words``; ``cut_after``: the connection closes after that many."""

    def __init__(self, words: list[str], cut_after: int | None = None) -> None:
        self.words, self.cut_after = words, cut_after
        self.bodies: list[dict[str, Any]] = []

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "base"}]})

    async def chat(self, _: web.Request) -> web.Response:
        message = "this model has no chat template: use /v1/completions"
        return web.json_response({"error": {"message": message}}, status=400)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index, word in enumerate(self.words):
            if index == self.cut_after:
                assert request.transport is not None
                request.transport.close()  # a crash mid-reply
                return response
            logprobs = legacy_logprobs(word, -0.5 - index) if body.get("logprobs") else None
            await response.write(legacy_chunk(word, logprobs=logprobs))
        await response.write(legacy_chunk("", "length"))
        usage = {"prompt_tokens": 7, "completion_tokens": len(self.words), "total_tokens": 0}
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode())
        await response.write(b"\n\ndata: [DONE]\n\n")
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.complete)
        return app


class ChatOnlyServer(BaseModelServer):
    """A hosted API's way: chat only, no legacy completions route (aiohttp's 404 page)."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        return app


class ChatModelServer(Upstream):
    """OpenAI's own way with a chat model: chat served, and the legacy route a 404 whose
    words name the model."""

    def __init__(self, models: list[str]) -> None:
        super().__init__(models)
        self.legacy_asked = 0

    async def no_legacy(self, _: web.Request) -> web.Response:
        self.legacy_asked += 1
        message = (
            "This is a chat model and not supported in the v1/completions endpoint. "
            "Did you mean to use v1/chat/completions?"
        )
        error = {"message": message, "type": "invalid_request_error", "param": "model"}
        return web.json_response({"error": {**error, "code": None}}, status=404)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.no_legacy)
        return app


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)


async def not_found(url: str, model: str) -> dict[str, Any]:
    """The body of the 404 a legacy completion for ``model`` gets through the relay."""
    async with client(url) as sdk:
        try:
            await sdk.completions.create(model=model, prompt="p")
        except openai.NotFoundError as exc:
            assert isinstance(exc.body, dict), exc.body
            return exc.body
    raise AssertionError(f"a legacy completion for {model!r} was answered")


async def test_the_prompt_goes_up_as_written_to_the_upstreams_own_completions_route():
    base = BaseModelServer(["return ", "a + b"])
    async with relay([base]) as url, client(url) as sdk:
        whole = await sdk.completions.create(
            model="base", prompt=FIM, max_tokens=9, temperature=0.2, stop=["\n\n"], seed=3
        )
        streamed = await sdk.completions.create(model="base", prompt=FIM, stream=True)
        texts = [chunk.choices[0].text async for chunk in streamed if chunk.choices]
    assert whole.choices[0].text == "return a + b" and whole.model == "base"
    assert whole.usage is not None and whole.usage.prompt_tokens == 7
    assert "".join(texts) == "return a + b"
    sent = base.bodies[0]
    # No chat template, no messages: the fill-in markup reaches the model as the client wrote it.
    assert sent["prompt"] == FIM and "messages" not in sent
    assert (sent["max_tokens"], sent["temperature"], sent["stop"], sent["seed"]) == (
        9,
        0.2,
        ["\n\n"],
        3,
    )
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert base.bodies[1]["max_tokens"] == 16  # OpenAI's default for a legacy completion


async def test_legacy_log_probabilities_come_back_in_the_legacy_shape():
    base = BaseModelServer(["return ", "a"])
    async with relay([base]) as url, client(url) as sdk:
        got = await sdk.completions.create(model="base", prompt="def f():", logprobs=2)
    assert base.bodies[0]["logprobs"] == 2 and "top_logprobs" not in base.bodies[0]
    logprobs = got.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["return ", "a"]
    assert logprobs.token_logprobs == [-0.5, -1.5]
    assert logprobs.top_logprobs == [{"return ": -0.5, "zz": -2.5}, {"a": -1.5, "zz": -3.5}]


async def test_several_choices_are_each_one_completion_upstream():
    base = BaseModelServer(["x"])
    async with relay([base]) as url, client(url) as sdk:
        got = await sdk.completions.create(model="base", prompt="p", n=3)
    assert sorted(choice.index for choice in got.choices) == [0, 1, 2]
    assert [choice.text for choice in got.choices] == ["x"] * 3
    assert len(base.bodies) == 3 and all("n" not in body for body in base.bodies)


async def test_a_reply_cut_mid_way_continues_with_the_text_so_far_at_the_prompts_end():
    first = BaseModelServer(["alpha ", "beta ", "gamma "], cut_after=2)
    second = BaseModelServer(["delta"])
    async with relay([first, second], continuation=True, failures=1) as url:
        got = await post_events(
            f"{url}/v1/completions",
            {"model": "base", "prompt": "Once ", "max_tokens": 10, "stream": True},
        )
    assert got.status == 200, got.raw
    text = "".join(
        json.loads(e.data)["choices"][0]["text"]
        for e in got.events
        if e.data != "[DONE]" and json.loads(e.data)["choices"]
    )
    assert text == "alpha beta delta"  # no gap, nothing twice
    assert second.bodies[0]["prompt"] == "Once alpha beta "
    assert second.bodies[0]["max_tokens"] == 8  # what is left of the budget
    assert got.events[-1].data == "[DONE]"


async def test_an_upstream_serving_chat_alone_is_passed_over_not_taken_out():
    chat_only, base = ChatOnlyServer([]), BaseModelServer(["ok"])
    async with relay([chat_only, base], failures=1) as url, client(url) as sdk:
        answers = [await sdk.completions.create(model="base", prompt="p") for _ in range(3)]
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as page:
            metrics = await page.text()
    assert [a.choices[0].text for a in answers] == ["ok"] * 3
    lines = metrics.splitlines()
    circuits = [line for line in lines if line.startswith("replystream_upstream_circuit{")]
    assert len(circuits) == 2 and all(line.endswith(" 0.0") for line in circuits), circuits
    no_route = [
        line
        for line in metrics.splitlines()
        if line.startswith("replystream_upstream_attempts{") and 'result="no_route"' in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in no_route) >= 1, no_route  # asked
    async with relay([ChatOnlyServer([])]) as url:
        error = await not_found(url, "base")
    assert error["code"] == "route_unsupported", error
    assert "/completions: it has no such route" in error["message"]


async def test_a_legacy_routes_404_for_a_chat_model_leaves_its_chat_requests_alone():
    """A 404 naming the model on the legacy route says that route lacks it, not chat: the
    completion goes on to the next upstream, and the chat requests for the model still go
    to both upstreams as the round robin has it (not to the other one first, as after a
    chat request's 404)."""
    chat_only, both = ChatModelServer(["chatty"]), Upstream(["chatty"])
    async with relay([chat_only, both]) as url, client(url) as sdk:
        completions = [await sdk.completions.create(model="chatty", prompt="p") for _ in range(2)]
        asked_before = len(chat_only.bodies)
        for _ in range(4):
            await sdk.chat.completions.create(
                model="chatty", messages=[{"role": "user", "content": "hi"}]
            )
    assert [c.choices[0].text for c in completions] == ["w0 w1 w2 "] * 2
    assert chat_only.legacy_asked == 1  # the round robin sent it one; it went on to the other
    assert len(chat_only.bodies) - asked_before == 2, "its chat requests went elsewhere first"
    async with relay([ChatModelServer(["chatty"])]) as url:
        error = await not_found(url, "chatty")
    assert error["code"] == "model_not_found", error
    assert "This is a chat model" in error["message"], error


async def test_a_token_named_by_its_bytes_counts_as_those_bytes_in_the_offsets():
    """An upstream names a token that is part of a character ``bytes:`` and its bytes
    escaped, as OpenAI's legacy completions do (and this server): its offset counted the 14
    characters of the name, so every offset after it was wrong."""

    class PartialCharacters(BaseModelServer):
        async def complete(self, request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            # U+1F600 in two tokens of two bytes each, in the chunk of its whole character (as
            # this server sends one), then a word.
            halves = ["bytes:\\xf0\\x9f", "bytes:\\x98\\x80"]
            probs = {
                "tokens": halves,
                "token_logprobs": [-0.5, -0.5],
                "top_logprobs": [{name: -0.5} for name in halves],
            }
            await response.write(legacy_chunk("\U0001f600", logprobs=probs))
            probs = {"tokens": [" ok"], "token_logprobs": [-0.5], "top_logprobs": [{" ok": -0.5}]}
            await response.write(legacy_chunk(" ok", logprobs=probs))
            await response.write(legacy_chunk("", "stop") + b"data: [DONE]\n\n")
            return response

    async with relay([PartialCharacters([])]) as url, client(url) as sdk:
        got = await sdk.completions.create(model="base", prompt="Hi", logprobs=1)
    logprobs = got.choices[0].logprobs
    assert logprobs is not None and got.choices[0].text == "\U0001f600 ok"
    assert logprobs.tokens == ["bytes:\\xf0\\x9f", "bytes:\\x98\\x80", " ok"]
    # After the prompt's 2 characters: the emoji is one character, begun by its first token.
    assert logprobs.text_offset == [2, 2, 3]
