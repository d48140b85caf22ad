"""``POST /v1/embeddings`` relayed: against small aiohttp upstreams on loopback ports that
make embeddings of their own, replystream serving an ``UpstreamEngine`` on another, and the
official OpenAI SDK (whose default asks for base64) as a client. Routing by model and alias,
failover before an answer with its circuit and access-log lines, refusals passed on in our
words, room at an upstream's limit, no fallback to another model's vectors, per-key prompt
tokens, and the route's own checks."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import logging
import re
import struct
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from replystream.engine.simulated import SimulatedConfig, SimulatedEngine
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.rawhttp import raw_request


def vector(text: str, index: int) -> list[float]:
    """An upstream's embedding of ``text``: exact in float32, so base64 and JSON agree."""
    return [float(len(text)), float(index), 0.5, -0.25]


# Embeddings no client can read, as an upstream might write them.
BAD_VECTORS = {
    "words": b'["a", null, {}]',
    "nan": b"[0.5, NaN, Infinity]",
    "nested": b"[0.5, [0.25]]",
    "not_base64": b'"!!!not base64"',
    "ragged_base64": b'"AAAAAAA="',  # 5 bytes: no whole float32s
}


# llama-cpp-python's server's answer (0.3.36, ``--embedding true``) for "Hi" on SmolLM2's GGUF,
# a chat model that pools no vector of a text: one vector per token (here one token), written
# as it wrote them, but for their 576 dimensions cut to 4 and its model's path.
PER_TOKEN_ANSWER = (
    b'{"object":"list","data":[{"object":"embedding","embedding":[[-0.5418130159378052,'
    b'-0.7885620594024658,0.030401350930333138,1.1082793474197388]],"index":0}],'
    b'"model":"/srv/models/SmolLM2-135M-Instruct.Q4_1.gguf",'
    b'"usage":{"prompt_tokens":1,"total_tokens":1}}'
)


class EmbeddingUpstream:
    """An OpenAI-compatible embeddings server answering as ``mode`` says."""

    def __init__(self, models: list[str], mode: str = "ok", slow_s: float = 0.3) -> None:
        self.models, self.mode, self.slow_s = models, mode, slow_s
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = self.most_in_flight = 0
        self.left = 0  # requests whose relay closed the connection before the answer
        self.requested = asyncio.Event()  # set by the first request
        self.large = b""  # the answer, as written, in mode "large"

    async def list_models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({name.lower(): value for name, value in request.headers.items()})
        self.requested.set()
        if self.mode == "busy":
            return web.json_response({"error": {"message": "busy"}}, status=503)
        if self.mode == "refuse":
            message = "This model's maximum context length is 512 tokens"
            return web.json_response({"error": {"message": message, "param": "input"}}, status=400)
        if self.mode == "chat_only":  # llama.cpp's server started without --embeddings
            message = "This server does not support embeddings. Start it with `--embeddings`"
            return web.json_response({"error": {"message": message}}, status=501)
        if self.mode == "chat_only_500":  # llama-cpp-python's server without --embedding
            message = "Llama model must be created with embedding=True to call this method"
            error = {"message": message, "type": "internal_server_error"}
            return web.json_response({"error": error}, status=500)
        if self.mode == "per_token":  # llama-cpp-python's for a model without pooling
            return web.Response(body=PER_TOKEN_ANSWER, content_type="application/json")
        if self.mode == "large":
            return web.Response(body=self.large, content_type="application/json")
        if self.mode == "gzip":  # compressed though asked for none (a gateway's doing)
            written = gzip.compress(b'{"object": "list", "data": [], "model": "m"}')
            headers = {"Content-Encoding": "gzip"}
            return web.Response(body=written, content_type="application/json", headers=headers)
        if self.mode == "garbage":
            return web.json_response({"object": "list", "data": "no"})
        if self.mode in BAD_VECTORS:  # a list of embeddings, one of which no client reads
            item = b'{"object": "embedding", "index": 0, "embedding": ' + BAD_VECTORS[self.mode]
            written = b'{"object": "list", "data": [' + item + b'}], "model": "m"}'
            return web.Response(body=written, content_type="application/json")
        if self.mode == "stall_body":  # a head and part of the body, then nothing for a while
            response = web.StreamResponse(headers={"Content-Length": "1000"})
            await response.prepare(request)
            await response.write(b'{"object": "list", "data": [')
            await asyncio.sleep(2)
            return response
        if self.mode == "cut":  # a head, part of the body, then the connection is gone
            response = web.StreamResponse(headers={"Content-Length": "1000"})
            await response.prepare(request)
            await response.write(b'{"object": "list", "data": [')
            assert request.transport is not None
            request.transport.close()
            return response
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.mode == "slow":
                try:
                    await asyncio.sleep(self.slow_s)
                except asyncio.CancelledError:  # its client (the relay) closed the connection
                    self.left += 1
                    raise
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            if inputs and isinstance(inputs[0], int):
                inputs = [inputs]  # one input as token ids
            data = []
            for index, item in enumerate(inputs):
                text = item if isinstance(item, str) else "t" * len(item)
                made: Any = vector(text, index)
                if body.get("encoding_format") == "base64":
                    made = base64.b64encode(struct.pack(f"<{len(made)}f", *made)).decode()
                data.append({"object": "embedding", "index": index, "embedding": made})
            tokens = sum(len(str(i).split()) for i in inputs)
            answer = {
                "object": "list",
                "data": data,
                "model": body.get("model", "its-own"),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
            return web.json_response(answer)
        finally:
            self.in_flight -= 1

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        if self.mode != "no_route":  # a chat server's: no such route, aiohttp's 404 page
            app.router.add_post("/v1/embeddings", self.embeddings)
        return app


@asynccontextmanager
async def relay(
    upstreams: list[EmbeddingUpstream], dead: int = 0, **config: Any
) -> AsyncIterator[str]:
    """replystream relaying ``upstreams`` (after ``dead`` of them: ports nothing listens on)."""
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(running(u.app())) for u in upstreams]
        targets = [UpstreamTarget(f"{url}/v1") for url in urls]
        for _ in range(dead):
            async with running(web.Application()) as gone:
                pass  # its port is free again: a connection is refused
            targets.insert(0, UpstreamTarget(f"{gone}/v1", models=("m",)))
        engine = UpstreamEngine(UpstreamConfig(tuple(targets), **config))
        yield await stack.enter_async_context(running(create_app(engine)))


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/embeddings", json=body, headers=headers) as response,
    ):
        return response.status, await response.json()


def attempt_lines(caplog: pytest.LogCaptureFixture, request_id: str) -> list[tuple[int, str]]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if '"attempt"' in r.getMessage()]
    return [(line["attempt"], line["result"]) for line in lines if line["request_id"] == request_id]


async def test_the_openai_sdk_reads_embeddings_relayed_in_base64_and_as_numbers():
    a, b = EmbeddingUpstream(["chat-model"]), EmbeddingUpstream(["embedder"])
    async with (
        relay([a, b], aliases=(("text-embedding-3-small", "embedder"),)) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        packed = await client.embeddings.create(
            model="text-embedding-3-small", input=["hello", "a longer text"]
        )
        plain = await client.embeddings.create(
            model="embedder", input="hi", encoding_format="float", dimensions=4
        )
    # The SDK asked for base64 and decoded it: the upstream's numbers, in order.
    assert [item.embedding for item in packed.data] == [
        vector("hello", 0),
        vector("a longer text", 1),
    ]
    assert packed.model == "text-embedding-3-small"  # the name asked for, as a chat reply's
    assert packed.usage.prompt_tokens == 4
    assert plain.data[0].embedding == vector("hi", 0) and plain.model == "embedder"
    assert not a.bodies  # routed by model: only the upstream serving it was asked
    assert b.bodies[0] == {
        "input": ["hello", "a longer text"],
        "encoding_format": "base64",
        "model": "embedder",
    }
    assert b.bodies[1] == {
        "input": "hi",
        "encoding_format": "float",
        "dimensions": 4,
        "model": "embedder",
    }


async def test_a_large_answer_goes_on_byte_for_byte():
    """A batch's answer of 6 MB (256 inputs of 1,536 numbers) is checked in slices and
    relayed as the upstream wrote it: numbers spelt as no JSON writer would write them again
    (``-1.2345678E-02``) arrive so, which they would not had the answer been parsed whole
    and written again. (What the slices spare the loop is measured by
    ``benchmarks/relay/embeddings_answer.py``.)"""
    row = b"[" + b",".join([b"-1.2345678E-02", b"5.0000E-1"] * 768) + b"]"
    items = (b'{"object":"embedding","index":%d,"embedding":%s}' % (i, row) for i in range(256))
    answer = b'{"object":"list","data":[%s],"model":"e","usage":{"prompt_tokens":256}}' % (
        b",".join(items)
    )
    upstream = EmbeddingUpstream(["e"], mode="large")
    upstream.large = answer
    async with relay([upstream]) as url, aiohttp.ClientSession() as session:
        body = {"model": "e", "input": ["x"] * 256, "encoding_format": "float"}
        headers = {"Accept-Encoding": "identity"}  # (this client's own inflating aside)
        async with session.post(f"{url}/v1/embeddings", json=body, headers=headers) as response:
            status, got = response.status, await response.read()
    assert status == 200 and got == answer


async def test_an_answer_counts_its_bytes_as_sent_as_they_went_out():
    # Gzipped for a client that takes it (the vectors' digits compress well): its bytes on the
    # wire, which were counted nowhere.
    async with relay([EmbeddingUpstream(["e"])]) as url:
        body = {"model": "e", "input": ["x"] * 64, "encoding_format": "float"}
        answers = []
        for coding in ("gzip", "identity"):
            headers = {"Content-Type": "application/json", "Accept-Encoding": coding}
            answer = await raw_request(
                f"{url}/v1/embeddings", "POST", json.dumps(body).encode(), headers
            )
            answers.append(await answer.read_body())
            assert answer.headers.get("content-encoding", "identity") == coding
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    counted = re.search(
        rb'replystream_bytes_sent_total\{endpoint="/v1/embeddings"\} (\S+)', metrics
    )
    assert counted and float(counted[1]) == sum(map(len, answers))


async def test_token_ids_go_through_as_token_ids():
    up = EmbeddingUpstream(["e"])
    async with relay([up]) as url:
        one = await post(url, {"model": "e", "input": [1, 2, 3]})
        many = await post(url, {"model": "e", "input": [[1, 2], [3]]})
    assert one[0] == 200 and len(one[1]["data"]) == 1
    assert many[0] == 200 and [d["embedding"][0] for d in many[1]["data"]] == [2.0, 1.0]
    assert [body["input"] for body in up.bodies] == [[1, 2, 3], [[1, 2], [3]]]


async def test_a_failing_upstream_is_passed_over_invisibly_and_its_circuit_opens(caplog):
    busy, ok = EmbeddingUpstream(["m"], mode="busy"), EmbeddingUpstream(["m"])
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with relay([busy, ok], failures=1, routing="least") as url:
        first = await post(url, {"model": "m", "input": "x"}, {"X-Request-Id": "e1"})
        second = await post(url, {"model": "m", "input": "y"}, {"X-Request-Id": "e2"})
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as got:
            metrics = await got.text()
    assert first[0] == 200 and second[0] == 200
    assert len(busy.bodies) == 1 and len(ok.bodies) == 2  # its circuit open: not asked again
    assert attempt_lines(caplog, "e1") == [(1, "overloaded"), (2, "ok")]
    assert attempt_lines(caplog, "e2") == []  # one attempt, and it answered: no line
    circuits = {
        line.split('"')[1]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("replystream_upstream_circuit{")
    }
    assert sorted(circuits.values()) == [0.0, 2.0]  # the busy one open, the other closed
    attempts = [
        line for line in metrics.splitlines() if line.startswith("replystream_upstream_attempts")
    ]
    assert any('result="overloaded"' in line and line.endswith(" 1.0") for line in attempts)
    assert any('result="ok"' in line and line.endswith(" 2.0") for line in attempts)


async def test_a_dead_upstream_and_a_cut_answer_are_failures_another_upstream_answers():
    cut, ok = EmbeddingUpstream(["m"], mode="cut"), EmbeddingUpstream(["m"])
    async with relay([cut, ok], dead=1) as url:
        got = [await post(url, {"model": "m", "input": "x"}) for _ in range(3)]
    assert all(status == 200 for status, _ in got), got
    assert len(ok.bodies) == 3


@pytest.mark.parametrize("mode", sorted(BAD_VECTORS))
async def test_an_embedding_no_client_reads_is_the_upstreams_failure(mode: str):
    async with relay([EmbeddingUpstream(["m"], mode=mode)]) as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 502 and body["error"]["code"] == "upstream_bad_response", body
    bad, ok = EmbeddingUpstream(["m"], mode=mode), EmbeddingUpstream(["m"])
    async with relay([bad, ok]) as url:
        got = [await post(url, {"model": "m", "input": "x"}) for _ in range(3)]
    assert all(status == 200 for status, _ in got), got  # the next upstream answered


async def test_upstreams_that_make_no_embeddings_are_passed_over_and_stay_in_chat_routing():
    """A chat-only upstream (no such route: aiohttp's 404 page; llama.cpp's 501) is not sick:
    its circuit stays closed, the next upstream answers, and with none left it is a 404."""
    no_route = EmbeddingUpstream(["m"], mode="no_route")
    chat_only, ok = EmbeddingUpstream(["m"], mode="chat_only"), EmbeddingUpstream(["m"])
    async with relay([no_route, chat_only, ok], failures=1) as url:
        got = [await post(url, {"model": "m", "input": "x"}) for _ in range(3)]
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as page:
            metrics = await page.text()
    assert [status for status, _ in got] == [200, 200, 200]
    circuits = [
        line for line in metrics.splitlines() if line.startswith("replystream_upstream_circuit{")
    ]
    assert len(circuits) == 3 and all(line.endswith(" 0.0") for line in circuits), circuits
    passed_over = [
        line
        for line in metrics.splitlines()
        if line.startswith("replystream_upstream_attempts{")
        and 'result="no_route"' in line
        and not line.endswith(" 0.0")
    ]
    assert len(passed_over) == 2, passed_over  # both were asked, and counted as such
    async with relay([EmbeddingUpstream(["m"], mode="chat_only")]) as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 404 and body["error"]["code"] == "route_unsupported"
    assert "/embeddings: it has no such route" in body["error"]["message"]
    assert "does not support embeddings" in body["error"]["message"]  # its own words, quoted


async def test_llama_cpp_pythons_500_without_embeddings_is_a_route_it_lacks():
    """llama-cpp-python's server started without ``--embedding`` says so in a 500: no sign of
    sickness, so its circuit stays closed however often it is asked, and chat goes on."""
    upstream = EmbeddingUpstream(["m"], mode="chat_only_500")
    async with relay([upstream], failures=1) as url:
        got = [await post(url, {"model": "m", "input": "x"}) for _ in range(3)]
        async with aiohttp.ClientSession() as session, session.get(f"{url}/healthz") as page:
            health = page.status
    assert [status for status, _ in got] == [404, 404, 404]
    body = got[-1][1]
    assert body["error"]["code"] == "route_unsupported"
    assert "/embeddings: it has no such route" in body["error"]["message"]
    assert "embedding=True" in body["error"]["message"]  # its own words, quoted
    assert health == 200


async def test_a_vector_per_token_is_a_model_that_makes_no_embeddings_not_a_sick_upstream():
    """llama-cpp-python's server started with ``--embedding`` on a chat model answers a vector
    per token: no embedding a client can use, and no sign of sickness either. Counted on its
    circuit, three such requests took the upstream out of routing, chat's too, for everyone."""
    upstream = EmbeddingUpstream(["m"], mode="per_token")
    async with relay([upstream], failures=1) as url:
        got = [await post(url, {"model": "m", "input": "Hi"}) for _ in range(3)]
        async with aiohttp.ClientSession() as session, session.get(f"{url}/healthz") as page:
            health = page.status
    assert [status for status, _ in got] == [404, 404, 404], got
    error = got[-1][1]["error"]
    assert error["code"] == "route_unsupported"
    assert "a vector for each token of an input" in error["message"]
    assert health == 200
    per_token, ok = EmbeddingUpstream(["m"], mode="per_token"), EmbeddingUpstream(["m"])
    async with relay([per_token, ok], failures=1) as url:
        got = [await post(url, {"model": "m", "input": "Hi"}) for _ in range(3)]
    assert [status for status, _ in got] == [200, 200, 200], got
    # Asked again after its first such answer (first in turn for two of the three): its
    # circuit, which opens at the first failure here, stayed closed.
    assert len(per_token.bodies) >= 2


async def test_an_upstream_slower_than_the_timeout_is_passed_over_head_or_body(caplog):
    slow, ok = EmbeddingUpstream(["m"], mode="slow", slow_s=10.0), EmbeddingUpstream(["m"])
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with relay([slow, ok], headers_timeout_s=1.0) as url:
        got = await post(url, {"model": "m", "input": "x"}, {"X-Request-Id": "s1"})
    assert got[0] == 200 and len(slow.bodies) == 1 and len(ok.bodies) == 1
    assert attempt_lines(caplog, "s1") == [(1, "head_timeout"), (2, "ok")]
    async with relay([EmbeddingUpstream(["m"], mode="stall_body")], headers_timeout_s=0.3) as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 504 and body["error"]["code"] == "upstream_timeout"
    assert "did not send its whole answer within 0.3 s" in body["error"]["message"]


async def test_what_every_upstream_fails_at_is_said_in_our_words():
    async with relay([EmbeddingUpstream(["m"], mode="garbage")]) as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 502
    assert body["error"]["code"] == "upstream_bad_response"
    assert "answered something other than a list of embeddings" in body["error"]["message"]
    async with relay([EmbeddingUpstream(["m"], mode="cut")]) as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 502 and "closed the connection mid-answer" in body["error"]["message"]
    async with relay([EmbeddingUpstream(["m"], mode="gzip")]) as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 502 and body["error"]["code"] == "upstream_bad_response"
    assert "answered a gzip-compressed body, though asked for none" in body["error"]["message"]
    async with relay([EmbeddingUpstream(["m"], mode="busy")]) as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 503 and body["error"]["code"] == "upstream_overloaded"


async def test_a_refusal_of_the_request_is_the_clients_and_goes_nowhere_else():
    refuse, ok = EmbeddingUpstream(["m"], mode="refuse"), EmbeddingUpstream(["m"])
    async with relay([refuse, ok], routing="least") as url:
        status, body = await post(url, {"model": "m", "input": "x"})
    assert status == 400
    assert body["error"]["param"] == "input"
    assert "maximum context length is 512 tokens" in body["error"]["message"]
    assert not ok.bodies


async def test_a_models_fallbacks_are_never_its_embeddings():
    """Another model's vectors are in another space: no fallback, the failure is the client's."""
    big, small = EmbeddingUpstream(["big"], mode="busy"), EmbeddingUpstream(["small"])
    async with relay([big, small], fallbacks=(("big", ("small",)),)) as url:
        status, body = await post(url, {"model": "big", "input": "x"})
    assert status == 503 and body["error"]["code"] == "upstream_overloaded"
    assert not small.bodies


async def test_requests_past_an_upstreams_limit_wait_for_room():
    up = EmbeddingUpstream(["m"], mode="slow")
    async with relay([up], max_outstanding=1) as url:
        got = await asyncio.gather(*(post(url, {"model": "m", "input": "x"}) for _ in range(3)))
    assert [status for status, _ in got] == [200, 200, 200]
    assert up.most_in_flight == 1


async def test_a_model_no_upstream_serves_is_a_404():
    async with relay([EmbeddingUpstream(["m"])]) as url:
        status, body = await post(url, {"model": "nope", "input": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_prompt_tokens_are_counted_per_key():
    up = EmbeddingUpstream(["m"])
    server = ServerConfig(api_keys=("sk-one",))
    async with AsyncExitStack() as stack:
        upstream_url = await stack.enter_async_context(running(up.app()))
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream_url}/v1"),)))
        url = await stack.enter_async_context(running(create_app(engine, server)))
        headers = {"Authorization": "Bearer sk-one"}
        status, _ = await post(url, {"model": "m", "input": ["a b c", "d"]}, headers)
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as got:
            metrics = await got.text()
    assert status == 200
    prompt = [
        line
        for line in metrics.splitlines()
        if line.startswith("replystream_key_tokens_total{") and 'kind="prompt"' in line
    ]
    assert len(prompt) == 1 and prompt[0].endswith(" 4.0"), prompt
    assert 'replystream_replies_total{endpoint="/v1/embeddings",outcome="finished"} 1.0' in metrics


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": ""}, "input must not be an empty string"),
        ({"model": "m", "input": []}, "non-empty list"),
        ({"model": "m", "input": ["a", [1]]}, "of one kind"),
        ({"model": "m", "input": ["a", ""]}, "input[1] must not be an empty string"),
        ({"model": "m", "input": [[1], [1, 2**31]]}, "input[1]"),  # its param, nested
        ({"model": "m", "input": [int("9" * 400)]}, "from 0 to 2147483647"),
        ({"model": "m", "input": "x", "dimensions": 10**20}, "dimensions"),
        ({"model": "m", "input": [1, -2]}, "token ids"),
        ({"model": "m", "input": ["x"] * 2049}, "at most 2048 inputs"),
        ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
        ({"model": "m", "input": "x", "truncate": True}, "truncate"),
        ({"model": "m", "input": True}, "input"),
    ],
)
async def test_a_bad_request_is_a_400_naming_what_is_wrong(body, words):
    up = EmbeddingUpstream(["m"])
    async with relay([up]) as url:
        status, answer = await post(url, body)
    assert status == 400, answer
    assert words in answer["error"]["message"] or words == answer["error"]["param"], answer
    assert not up.bodies
    if "input[1]" in words:  # the path of the input at fault, as OpenAI's errors name it
        assert answer["error"]["param"] == "input[1]", answer


async def test_an_engine_that_makes_no_embeddings_says_so():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=0, jitter_ms=0))
    async with running(create_app(engine)) as url:
        status, body = await post(url, {"input": "x"})
    assert status == 404
    assert body["error"]["code"] == "unsupported_endpoint"
    assert "makes no embeddings" in body["error"]["message"]


async def test_each_upstream_gets_its_own_key_or_the_callers_and_the_request_id():
    own, passing = EmbeddingUpstream(["a"]), EmbeddingUpstream(["b"])
    async with AsyncExitStack() as stack:
        own_url = await stack.enter_async_context(running(own.app()))
        passing_url = await stack.enter_async_context(running(passing.app()))
        targets = (
            UpstreamTarget(f"{own_url}/v1", api_key="sk-upstream"),
            UpstreamTarget(f"{passing_url}/v1", pass_client_key=True),
        )
        engine = UpstreamEngine(UpstreamConfig(targets))
        url = await stack.enter_async_context(running(create_app(engine)))
        headers = {"Authorization": "Bearer sk-caller", "X-Request-Id": "emb-1"}
        for model in ("a", "b"):
            status, _ = await post(url, {"model": model, "input": "x"}, headers)
            assert status == 200
        status, body = await post(url, {"model": "b", "input": "x"}, {"Authorization": "Bearer é"})
    assert own.headers[0]["authorization"] == "Bearer sk-upstream"  # never the caller's
    assert passing.headers[0]["authorization"] == "Bearer sk-caller"
    assert own.headers[0]["x-request-id"] == passing.headers[0]["x-request-id"] == "emb-1"
    assert own.headers[0]["accept"] == "application/json"  # not chat's event stream
    # A key no header can carry: the caller's to fix (401), and nothing sent.
    assert status == 401 and len(passing.bodies) == 1, body


async def test_a_client_that_leaves_closes_its_request_upstream():
    up = EmbeddingUpstream(["m"], mode="slow", slow_s=10.0)
    ended = 'replystream_replies_total{endpoint="/v1/embeddings",outcome="cancelled"} 1.0'
    async with relay([up]) as url, aiohttp.ClientSession() as session:
        asking = asyncio.create_task(
            session.post(f"{url}/v1/embeddings", json={"model": "m", "input": "x"})
        )
        await asyncio.wait_for(up.requested.wait(), 10.0)
        asking.cancel()  # the client leaves: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        metrics = ""
        for _ in range(100):  # until both ends have seen it (long before the answer's 10 s)
            async with session.get(f"{url}/metrics") as page:
                metrics = await page.text()
            if up.left and ended in metrics:
                break
            await asyncio.sleep(0.05)
    assert len(up.bodies) == 1 and up.left == 1  # its connection was closed, not left open
    assert ended in metrics


async def test_an_answer_that_took_its_upstream_a_while_spent_none_of_it_in_a_queue():
    # The time an upstream takes to make embeddings is no wait for room (the relay holds no
    # queue here: no limit). Counted as queue time, every embeddings answer showed as queued
    # for as long as its upstream worked on it.
    async with relay([EmbeddingUpstream(["e"], mode="slow", slow_s=0.5)]) as url:
        assert (await post(url, {"model": "e", "input": "x"}))[0] == 200
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as got:
            metrics = await got.text()
    counted = {
        (sample.name, tuple(sorted(sample.labels.values()))): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }
    at_route = ("/v1/embeddings",)
    assert counted["replystream_end_to_end_seconds_count", at_route] == 1
    assert counted["replystream_end_to_end_seconds_sum", at_route] >= 0.5
    assert counted.get(("replystream_queue_seconds_count", at_route), 0) == 0
    # Its prompt tokens still count: the upstream took the request up.
    assert counted["replystream_key_tokens_total", ("anonymous", "prompt")] == 1
