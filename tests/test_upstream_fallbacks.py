"""A model's fallbacks (the routes file's ``[fallbacks]``): a request none of its model's
upstreams can answer goes on to the next model's, invisibly to the client, before its first
text; against small aiohttp upstreams on loopback ports and replystream serving an
``UpstreamEngine`` on another."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from replystream.engine.upstream_routes import load_routes
from replystream.server.reload import change_line
from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, get_json, relay

BIG_TO_SMALL = (("big", ("small",)),)


def chunks(got: Any) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in got.events if e.type == "message" and e.data != "[DONE]"]


def texts(got: Any) -> dict[int, str]:
    """Each choice's text of a streamed chat reply."""
    made: dict[int, str] = {}
    for chunk in chunks(got):
        for choice in chunk["choices"]:
            index = choice["index"]
            made[index] = made.get(index, "") + (choice["delta"].get("content") or "")
    return made


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        **extra,
    }


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


async def test_a_model_whose_upstreams_all_fail_goes_on_to_its_fallback(caplog):
    big, small = Upstream(["big"], mode="busy"), Upstream(["small"])
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with relay([big, small], fallbacks=BIG_TO_SMALL, failures=1) as url:
        first = await post_events(f"{url}/v1/chat/completions", chat("big"), {"X-Request-Id": "r1"})
        # Its circuit open now, the next request goes to the fallback at once.
        second = await post_events(
            f"{url}/v1/chat/completions", chat("big"), {"X-Request-Id": "r2"}
        )
        direct = await post_events(f"{url}/v1/chat/completions", chat("small"))
        fallbacks = await metric(url, "replystream_upstream_fallbacks")
    for got in (first, second, direct):
        assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
    # The reply names the model asked for; the fallback's upstream was sent its own model.
    assert {chunk["model"] for chunk in chunks(first)} == {"big"}
    assert [body["model"] for body in small.bodies] == ["small", "small", "small"]
    assert len(big.bodies) == 1
    assert fallbacks == 2.0
    lines = [json.loads(r.getMessage()) for r in caplog.records if '"attempt"' in r.getMessage()]

    def attempts(request_id: str) -> list[tuple[int, str, str | None]]:
        return [
            (line["attempt"], line["result"], line.get("model"))
            for line in lines
            if line["request_id"] == request_id
        ]

    assert attempts("r1") == [(1, "overloaded", None), (2, "ok", "small")]
    # Straight to the fallback: one attempt, and its line says where it went.
    assert attempts("r2") == [(1, "ok", "small")]


async def test_every_dialect_names_the_model_asked_for_and_has_the_fallbacks_text():
    """Through the official SDKs: Anthropic's Messages, OpenAI's Responses and completions."""
    big, small = Upstream(["big"], mode="busy"), Upstream(["small"])
    ask = [{"role": "user", "content": "hi"}]
    async with (
        relay([big, small], fallbacks=BIG_TO_SMALL) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        message = await claude.messages.create(model="big", max_tokens=9, messages=ask)  # type: ignore[arg-type]
        response = await oai.responses.create(model="big", input="hi")
        completion = await oai.completions.create(model="big", prompt="hi")
    assert message.model == "big" and message.content[0].text == "w0 w1 w2 "  # type: ignore[union-attr]
    assert response.model == "big" and response.output_text == "w0 w1 w2 "
    assert completion.model == "big" and completion.choices[0].text == "w0 w1 w2 "
    assert [body["model"] for body in small.bodies] == ["small"] * 3


async def test_a_model_its_upstreams_stop_listing_goes_on_to_its_fallback():
    """A model whose upstreams list it no more (a server restarted with another model) is
    still a name the routes answer while a fallback of it is served: ``/v1/models`` lists it,
    and its chat requests go to the fallback's upstreams, named as asked; an embeddings
    request for it is a 404 (another model's vectors would lie in another space)."""
    big, small = Upstream(["big"]), Upstream(["small"])
    async with relay([big, small], fallbacks=BIG_TO_SMALL, health_s=0.05) as url:
        big.models = ["other"]
        for _ in range(200):  # until a probe has read the new list
            _, listing = await get_json(f"{url}/v1/models")
            names = [model["id"] for model in listing["data"]]
            if "other" in names:
                break
            await asyncio.sleep(0.02)
        got = await post_events(f"{url}/v1/chat/completions", chat("big"))
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/embeddings", json={"model": "big", "input": "x"}) as answer,
        ):
            vectors_status, vectors = answer.status, await answer.json()
    assert names == ["other", "small", "big"]
    assert got.status == 200, got.raw
    assert texts(got) == {0: "w0 w1 w2 "} and {c["model"] for c in chunks(got)} == {"big"}
    assert not big.bodies and [body["model"] for body in small.bodies] == ["small"]
    assert vectors_status == 404 and vectors["error"]["code"] == "model_not_found", vectors


async def test_without_fallbacks_the_same_failure_is_the_clients():
    async with relay([Upstream(["big"], mode="busy"), Upstream(["small"])]) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat("big"))
    assert got.status == 503
    assert json.loads(got.raw)["error"]["code"] == "upstream_overloaded"


async def test_a_model_at_its_limit_goes_on_to_its_fallback_rather_than_wait_in_line():
    big, small = Upstream(["big"], mode="slow"), Upstream(["small"])
    async with relay([big, small], fallbacks=BIG_TO_SMALL, max_outstanding=1) as url:
        began = time.monotonic()
        ended: dict[str, float] = {}

        async def ask(name: str) -> Any:
            got = await post_events(f"{url}/v1/chat/completions", chat("big"))
            ended[name] = time.monotonic() - began
            return got

        slow = asyncio.create_task(ask("slow"))
        await big.requested.wait()  # the one room at big's upstream taken
        quick = await ask("quick")
        await slow
    assert quick.status == 200 and quick.chat_text == "w0 w1 w2 "
    assert [body["model"] for body in small.bodies] == ["small"]
    assert len(big.bodies) == 1 and ended["quick"] < ended["slow"]


async def test_a_request_the_upstream_refuses_does_not_go_on_to_a_fallback():
    big, small = Upstream(["big"], mode="refuse"), Upstream(["small"])
    async with relay([big, small], fallbacks=BIG_TO_SMALL) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat("big"))
    assert got.status == 400 and small.bodies == []


# How upstreams say a request is past the model's context (their own error bodies).
TOO_LONG = {
    "vllm": (
        400,
        {
            "error": {
                "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This "
                "model's maximum context length is 4096 tokens and your request has 2778 input "
                "tokens (8000 > 4096 - 2778). None",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
    ),
    "llama.cpp": (
        400,
        {
            "error": {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 5000,
                "n_ctx": 4096,
            }
        },
    ),
    "tgi": (
        422,
        {
            "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
            "4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
            "error_type": "validation",
        },
    ),
    "sglang": (
        400,
        {
            "object": "error",
            "message": "The input (5000 tokens) is longer than the model's context length "
            "(4096 tokens).",
            "type": "BadRequestError",
            "code": 400,
        },
    ),
    "openai": (
        400,
        {
            "error": {
                "message": "This model's maximum context length is 128000 tokens. However, your "
                "messages resulted in 130000 tokens. Please reduce the length of the messages.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
    ),
}


@pytest.mark.parametrize("server", TOO_LONG)
async def test_a_prompt_past_the_models_context_goes_on_to_its_fallback(server: str):
    big, small = Upstream(["big"], mode="refuse"), Upstream(["small"])
    big.refusal = TOO_LONG[server]
    async with relay([big, small], fallbacks=BIG_TO_SMALL) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat("big", max_tokens=8000))
    assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
    assert len(big.bodies) == 1 and [body["model"] for body in small.bodies] == ["small"]


@pytest.mark.parametrize("server", TOO_LONG)
async def test_with_no_fallback_a_prompt_past_the_context_is_said_as_our_engines_say_it(
    server: str,
):
    """The built-in engines' code, which clients (the chat page among them) act on; vLLM's
    words for a token limit past the context name max_tokens beside max_completion_tokens,
    and are no refusal of the field: the request is not sent again under the other name."""
    big = Upstream(["big"], mode="refuse")
    big.refusal = TOO_LONG[server]
    async with relay([big]) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat("big", max_tokens=8000))
        again = await post_events(f"{url}/v1/chat/completions", chat("big", max_tokens=8000))
    for answer in (got, again):
        assert answer.status == 400, answer.raw
        assert json.loads(answer.raw)["error"]["code"] == "context_length_exceeded"
    assert [body.get("max_tokens") for body in big.bodies] == [8000, 8000]
    assert all("max_completion_tokens" not in body for body in big.bodies)


async def test_every_choice_of_a_request_goes_on_to_the_fallback():
    big, small = Upstream(["big"], mode="busy"), Upstream(["small"])
    async with relay([big, small], fallbacks=BIG_TO_SMALL) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat("big", n=2))
    assert got.status == 200, got.raw
    assert texts(got) == {0: "w0 w1 w2 ", 1: "w0 w1 w2 "}
    assert [body["model"] for body in small.bodies] == ["small", "small"]


async def test_a_reply_cut_mid_way_continues_at_the_fallback_when_allowed():
    big, small = Upstream(["big"], mode="cut"), Upstream(["small"], words=2)
    async with relay([big, small], fallbacks=BIG_TO_SMALL) as url:
        body = chat("big", upstream_continue=True)
        got = await post_events(f"{url}/v1/chat/completions", body)
    assert got.status == 200 and got.events[-1].data == "[DONE]", got.raw
    sent = small.bodies[0]
    assert sent["model"] == "small"
    assert sent["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2 "}
    # This fake upstream does not continue: it starts over, and the client reads what it sent.
    assert got.chat_text == "w0 w1 w2 " + "w0 w1 "


async def test_every_model_of_the_chain_failing_is_said_with_the_chain():
    big, small = Upstream(["big"], mode="busy"), Upstream(["small"], mode="busy")
    async with relay([big, small], fallbacks=BIG_TO_SMALL, failures=1) as url:
        await post_events(f"{url}/v1/chat/completions", chat("big"))
        got = await post_events(f"{url}/v1/chat/completions", chat("big"))
    assert got.status == 503
    error = json.loads(got.raw)["error"]
    assert error["code"] == "upstream_unavailable"
    assert "no upstream serving big or its fallbacks small can take a request" in error["message"]
    assert int(got.headers["retry-after"]) >= 1


def test_a_routes_files_fallbacks_are_read_as_models(tmp_path: Path):
    path = tmp_path / "routes.toml"
    path.write_text(
        "[[upstreams]]\nurl = 'http://a/v1'\nmodels = ['big', 'mid', 'small']\n"
        "[aliases]\nlarge = 'big'\ntiny = 'small'\n"
        "[fallbacks]\nlarge = ['mid', 'tiny']\n"
    )
    assert load_routes(path).fallbacks == (("big", ("mid", "small")),)


@pytest.mark.parametrize(
    ("fallbacks", "says"),
    [
        ("big = ['big']", "fallbacks.big: 'big' is the model itself"),
        ("large = ['big']", "fallbacks.large: 'big' is the model itself"),
        ("big = ['small', 'tiny']", "fallbacks.big: the model 'small' is listed twice"),
        ("big = ['none']", "fallbacks.big: no upstream lists the model 'none'"),
        ("none = ['big']", "fallbacks.none: no upstream lists the model 'none'"),
        (
            "big = ['small']\nlarge = ['small']",
            "fallbacks.large: the model 'big' is given fallbacks twice",
        ),
        ("big = []", "fallbacks.big: list should have at least 1 item"),
        ("big = 'small'", "fallbacks.big: input should be a valid list"),
    ],
)
def test_a_routes_files_fallbacks_are_checked_at_start(tmp_path: Path, fallbacks: str, says: str):
    path = tmp_path / "routes.toml"
    path.write_text(
        "[[upstreams]]\nurl = 'http://a/v1'\nmodels = ['big', 'small']\n"
        f"[aliases]\nlarge = 'big'\ntiny = 'small'\n[fallbacks]\n{fallbacks}\n"
    )
    with pytest.raises(ValueError) as raised:
        load_routes(path)
    assert str(raised.value).startswith(f"{path}: {says}")


def test_a_model_an_upstream_may_learn_later_is_taken_when_lists_are_not_all_known(
    tmp_path: Path,
):
    path = tmp_path / "routes.toml"
    path.write_text(
        "[[upstreams]]\nurl = 'http://a/v1'\n[[upstreams]]\nurl = 'http://b/v1'\n"
        "models = ['small']\n[fallbacks]\nbig = ['small']\n"
    )
    assert load_routes(path).fallbacks == BIG_TO_SMALL


def test_a_reload_says_how_many_models_have_fallbacks(tmp_path: Path):
    from replystream.engine.upstream import RouteChange

    change = RouteChange(added=(), removed=(), upstreams=2, aliases=1, fallbacks=2)
    assert change_line("r.toml", change).endswith(": 2 upstreams, 1 alias, 2 models with fallbacks")
    none = RouteChange(added=(), removed=(), upstreams=1, aliases=0, fallbacks=0)
    assert change_line("r.toml", none).endswith(": 1 upstream, 0 aliases")


async def test_under_load_every_request_is_answered_and_every_room_given_back():
    """Thirty requests at once, half of two choices, for a model whose upstreams are one busy
    and one slow, each taking two requests at once, and a fallback of two fast upstreams: each
    is answered, and once they are, no upstream counts a request out, none waits in line."""
    busy, slow = Upstream(["big"], mode="busy"), Upstream(["big"], mode="slow")
    fast = [Upstream(["small"]), Upstream(["small"])]
    async with relay([busy, slow, *fast], fallbacks=BIG_TO_SMALL, max_outstanding=2) as url:
        answers = await asyncio.gather(
            *(
                post_events(f"{url}/v1/chat/completions", chat("big", n=1 + i % 2))
                for i in range(30)
            )
        )
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/metrics") as response:
                metrics = await response.text()
    for i, got in enumerate(answers):
        assert got.status == 200, got.raw
        assert texts(got) == dict.fromkeys(range(1 + i % 2), "w0 w1 w2 "), got.raw
    counts = [line for line in metrics.splitlines() if line.startswith("replystream_upstream_")]
    outstanding = [line for line in counts if line.startswith("replystream_upstream_outstanding{")]
    assert len(outstanding) == 4 and all(line.endswith(" 0.0") for line in outstanding), counts
    assert "replystream_upstream_queued 0.0" in counts, counts
    assert sum(len(u.bodies) for u in fast) >= 30  # most went on to the fallback


async def test_more_choices_than_the_model_takes_at_once_go_to_a_fallback_that_takes_them():
    big, small = Upstream(["big"]), [Upstream(["small"]), Upstream(["small"])]
    async with relay([big, *small], fallbacks=BIG_TO_SMALL, max_outstanding=1) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat("big", n=2))
        three = await post_events(f"{url}/v1/chat/completions", chat("big", n=3))
    assert got.status == 200 and texts(got) == {0: "w0 w1 w2 ", 1: "w0 w1 w2 "}, got.raw
    assert big.bodies == [] and [len(u.bodies) for u in small] == [1, 1]
    assert three.status == 400, three.raw
    error = json.loads(three.raw)["error"]
    assert error["param"] == "n" and "(or any of its fallbacks: 'small')" in error["message"]
