"""vLLM's sampling extras, honoured by the built-in models and relayed from every dialect:
``min_p`` (tokens less likely than that share of the likeliest dropped), ``min_tokens`` (the
model's end tokens banned until that many tokens were made) and ``ignore_eos`` (banned
throughout: the reply runs to its token limit). Top-level on chat, completions and the native
route; under ``replystream`` on the Responses and Messages APIs, which have no such fields.

Real servers on loopback sockets: the tiny model (with an end token chosen from its own greedy
reply, so where it would end is known), and a relay in front of a small aiohttp upstream."""

from __future__ import annotations

import json

from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.sse_client import post_events
from tests.test_relay_response_format import ASK, JSONUpstream
from tests.test_upstream_routing import relay


async def test_min_p_goes_upstream_from_every_dialect_under_its_own_name():
    """vLLM's ``min_p``: top-level on chat, completions and the native route, replystream's
    own on the Responses and Messages APIs (which have no such field)."""
    up = JSONUpstream(["m"])
    async with relay([up]) as url:
        for path, body in (
            ("/v1/chat/completions", {"messages": ASK, "min_p": 0.1}),
            ("/v1/completions", {"prompt": "x", "min_p": 0.1}),
            ("/v1/replies", {"prompt": "x", "min_p": 0.1, "stream": False}),
            ("/v1/responses", {"input": "x", "replystream": {"min_p": 0.1}}),
            (
                "/v1/messages",
                {"model": "m", "max_tokens": 9, "messages": ASK, "replystream": {"min_p": 0.1}},
            ),
        ):
            got = await post_events(f"{url}{path}", body)
            assert got.status == 200, (path, got.raw)
            assert up.bodies[-1]["min_p"] == 0.1, path
        bad = await post_events(f"{url}/v1/chat/completions", {"messages": ASK, "min_p": 1.5})
    assert bad.status == 400 and json.loads(bad.raw)["error"]["param"] == "min_p"


async def test_the_built_in_model_honours_min_p():
    """At ``min_p`` 1 only the likeliest token is left at each step: a sampled reply is the
    greedy one, whatever its seed."""
    engine = load_default_engine(TinyEngineConfig())
    async with running(create_app(engine, ServerConfig(model_name="m"))) as url:
        replies = []
        for sampling in (
            {"temperature": 0},
            {"temperature": 1.5, "min_p": 1.0, "seed": 1},
            {"temperature": 1.5, "min_p": 1.0, "seed": 2},
            {"temperature": 1.5, "seed": 1},
        ):
            body = {"messages": ASK, "max_tokens": 24, **sampling}
            got = await post_events(f"{url}/v1/chat/completions", body)
            replies.append(json.loads(got.raw)["choices"][0]["message"]["content"])
    greedy, capped, capped_again, free = replies
    assert capped == capped_again == greedy
    assert free != greedy  # without it, this seed samples another reply


def tiny_ending_at(end: int) -> TinyEngine:
    """The tiny model, with ``end`` as its end-of-reply token (it has none of its own)."""
    default = load_default_engine()
    return TinyEngine(default.model, default.tokenizer, stop_tokens=frozenset({end}))


async def test_min_tokens_and_ignore_eos_hold_the_end_token_back():
    prompt = "And the LORD spake unto Moses, saying,"
    async with running(create_app(load_default_engine())) as url:
        free = await post_events(
            f"{url}/v1/completions",
            {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0},
        )
    tokens = json.loads(free.raw)["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 12
    end = load_default_engine().tokenizer.encode(tokens[3])[0]  # its fourth token, once alone
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    async with running(create_app(tiny_ending_at(end))) as url:
        ended, held, ignored = [
            json.loads((await post_events(f"{url}/v1/completions", {**body, **extra})).raw)
            for extra in ({}, {"min_tokens": 8}, {"ignore_eos": True})
        ]
        too_many = await post_events(f"{url}/v1/completions", {**body, "min_tokens": 13})
    first = tokens.index(tokens[3])  # where the end token first comes, greedily
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert ended["usage"]["completion_tokens"] == first + 1  # the end token counts, unshown
    for reply in (held, ignored):
        assert reply["usage"]["completion_tokens"] >= 8
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 12
    assert too_many.status == 400
    assert json.loads(too_many.raw)["error"]["param"] == "min_tokens"


async def test_min_tokens_and_ignore_eos_go_upstream_from_every_dialect():
    up = JSONUpstream(["m"])
    extras = {"min_tokens": 4, "ignore_eos": True}
    async with relay([up]) as url:
        for path, body in (
            ("/v1/chat/completions", {"messages": ASK, **extras}),
            ("/v1/completions", {"prompt": "x", **extras}),
            ("/v1/replies", {"prompt": "x", "stream": False, **extras}),
            ("/v1/responses", {"input": "x", "replystream": extras}),
            (
                "/v1/messages",
                {"model": "m", "max_tokens": 9, "messages": ASK, "replystream": extras},
            ),
        ):
            got = await post_events(f"{url}{path}", body)
            assert got.status == 200, (path, got.raw)
            sent = up.bodies[-1]
            assert (sent["min_tokens"], sent["ignore_eos"]) == (4, True), path
        await post_events(f"{url}/v1/chat/completions", {"messages": ASK})
    assert "min_tokens" not in up.bodies[-1] and "ignore_eos" not in up.bodies[-1]


async def test_min_tokens_past_max_tokens_is_refused_by_every_engine():
    # The check was the tiny engine's own: the simulated engine (which makes no end token to
    # hold back) answered such a request, and the relay passed it on.
    body = {"max_tokens": 2, "min_tokens": 5}
    up = JSONUpstream(["m"])
    async with running(create_app(fast_engine())) as simulated, relay([up]) as relayed:
        for url in (simulated, relayed):
            for path, extra in (
                ("/v1/chat/completions", {"messages": ASK}),
                ("/v1/replies", {"prompt": "x", "stream": False}),
            ):
                got = await post_events(f"{url}{path}", {**body, **extra})
                assert got.status == 400, (url, path, got.raw)
                error = json.loads(got.raw)["error"]
                assert error["param"] == "min_tokens" and "token limit (2)" in error["message"]
    assert up.bodies == []
