"""Fields as the relay writes them that an upstream refuses, never the client's mistake.
``stream_options``, added to every request to have the upstream's own usage: Azure OpenAI's
API versions before 2024-10-21 answer 400 "Unrecognized request argument supplied:
stream_options" (later "Unknown parameter" with that param), servers whose schema forbids
fields they do not know answer FastAPI's 422 (Mistral's API, inside an error of its own).
``max_tokens``, the relay's spelling of a token limit: OpenAI's reasoning models take only
``max_completion_tokens``. The request is sent again as the upstream asks, and every request
after it goes so. Also: a FastAPI 422 about a field the client did send is quoted and names
it. Real aiohttp upstreams on loopback ports, replystream serving an ``UpstreamEngine``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import wait_for
from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, relay

Answer = tuple[int, dict[str, Any]]


def openai_400(message: str, param: str | None, code: str | None) -> Answer:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return 400, {"error": error}


def fastapi_422(field: str) -> Callable[[dict[str, Any]], Answer | None]:
    """FastAPI's answer to a body holding ``field``, which its model forbids."""

    def refuse(body: dict[str, Any]) -> Answer | None:
        if field not in body:
            return None
        problem = {
            "type": "extra_forbidden",
            "loc": ["body", field],
            "msg": "Extra inputs are not permitted",
            "input": body[field],
        }
        return 422, {"detail": [problem]}

    return refuse


def mistral_422(field: str) -> Callable[[dict[str, Any]], Answer | None]:
    """Mistral's API's answer to a body holding ``field`` (FastAPI's inside its own error)."""
    fastapi = fastapi_422(field)

    def refuse(body: dict[str, Any]) -> Answer | None:
        refused = fastapi(body)
        if refused is None:
            return None
        problem = {**refused[1]["detail"][0], "loc": ["body", field, "include_usage"]}
        error = {"message": {"detail": [problem]}, "type": "invalid_request_error"}
        return 422, {"object": "error", **error, "param": None, "code": None}

    return refuse


def refusing_field(field: str, answer: Answer) -> Callable[[dict[str, Any]], Answer | None]:
    return lambda body: answer if field in body else None


# Azure OpenAI's answers, API versions before 2024-10-21: in words alone, then with its param.
AZURE = openai_400("Unrecognized request argument supplied: stream_options", None, None)
UNKNOWN_PARAMETER = openai_400(
    "Unknown parameter: 'stream_options'.", "stream_options", "unknown_parameter"
)
# OpenAI's answer for a reasoning model.
MAX_TOKENS_UNSUPPORTED = openai_400(
    "Unsupported parameter: 'max_tokens' is not supported with this model. "
    "Use 'max_completion_tokens' instead.",
    "max_tokens",
    "unsupported_parameter",
)


class Refusing(Upstream):
    """An upstream that answers what ``refuse`` says to a body it refuses, and streams as
    ``Upstream`` does to any other; ``refused`` counts the refusals."""

    def __init__(
        self,
        refuse: Callable[[dict[str, Any]], Answer | None],
        models: list[str] | None = None,
        usage_unasked: bool = False,
    ) -> None:
        super().__init__(models or ["m"])
        self.refuse = refuse
        self.refused = 0
        self.usage_unasked = usage_unasked  # as most do not, Mistral's API does

    async def chat(self, request: web.Request) -> web.StreamResponse:
        answer = self.refuse(await request.json())
        if answer is None:
            return await super().chat(request)
        self.bodies.append(await request.json())
        self.refused += 1
        return web.json_response(answer[1], status=answer[0])


@pytest.mark.parametrize(
    ("refuse", "usage_unasked"),
    [
        (refusing_field("stream_options", AZURE), False),
        (refusing_field("stream_options", UNKNOWN_PARAMETER), False),
        (fastapi_422("stream_options"), False),
        (mistral_422("stream_options"), True),
    ],
    ids=["azure", "unknown_parameter", "fastapi", "mistral"],
)
async def test_an_upstream_refusing_stream_options_is_sent_none_and_its_usage_still_told(
    refuse: Callable[[dict[str, Any]], Answer | None],
    usage_unasked: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = Refusing(refuse, usage_unasked=usage_unasked)
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    chat = {
        "messages": [{"role": "user", "content": "hi there"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with relay([up], failures=1) as url:
        for _ in range(3):  # more than --upstream-failures: nothing counted on its circuit
            got = await post_events(f"{url}/v1/chat/completions", chat)
            assert got.status == 200, got.raw
            assert got.chat_text == "w0 w1 w2 "
            usage = json.loads(got.events[-2].data)["usage"]
            assert usage["completion_tokens"] == 3  # the upstream's, or the chunks relayed
            # The upstream's own count (11) where it sends one unasked; else the relay's.
            assert (usage["prompt_tokens"] == 11) == usage_unasked, usage
            assert usage["prompt_tokens"] > 0
    # Refused once; sent again without it at once, and never again with it.
    assert ["stream_options" in body for body in up.bodies] == [True, False, False, False]
    warnings = [r.getMessage() for r in caplog.records if "stream_options" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "sent no stream_options from now on" in warnings[0]


async def test_a_model_that_takes_only_max_completion_tokens_is_sent_its_limit_so() -> None:
    def refuse(body: dict[str, Any]) -> Answer | None:
        reasoning = body["model"] == "reasoner"
        return MAX_TOKENS_UNSUPPORTED if reasoning and "max_tokens" in body else None

    up = Refusing(refuse, ["reasoner", "m"])
    ask = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with relay([up], failures=1) as url:
        for model, limit in [("reasoner", "max_completion_tokens"), ("reasoner", "max_tokens")]:
            got = await post_events(f"{url}/v1/chat/completions", {**ask, "model": model, limit: 7})
            assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
        got = await post_events(
            f"{url}/v1/chat/completions", {**ask, "model": "m", "max_tokens": 7}
        )
        assert got.status == 200, got.raw
    limits = [(b["model"], b.get("max_tokens"), b.get("max_completion_tokens")) for b in up.bodies]
    assert limits == [
        ("reasoner", 7, None),  # refused
        ("reasoner", None, 7),  # sent again as it asks
        ("reasoner", None, 7),  # and so from then on, for that model
        ("m", 7, None),  # but not for another
    ]
    assert up.refused == 1


async def test_a_models_name_in_the_line_saying_so_cannot_forge_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An upstream that lists no models is sent a model as the client named it; its name,
    with a line break in it, is quoted in the warning that its limit goes so from now on."""
    up = Refusing(lambda body: MAX_TOKENS_UNSUPPORTED if "max_tokens" in body else None)
    up.models = []  # none listed: any name is the upstream's to judge
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    forged = "x\n2026-01-01 00:00:00,000 CRITICAL replystream.server forged"
    ask = {"model": forged, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    async with relay([up], failures=1) as url:
        got = await post_events(f"{url}/v1/chat/completions", {**ask, "stream": True})
        assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
    said = [r.getMessage() for r in caplog.records if "max_completion_tokens" in r.getMessage()]
    assert len(said) == 1 and "forged" in said[0], said
    assert "\n" not in said[0], said


async def refused_at_the_limit(
    model: str, caplog: pytest.LogCaptureFixture
) -> tuple[str, list[str]]:
    """A request for ``model`` refused as its upstream's room is taken (a relay whose upstream
    lists no models passes any name on): the refusal's message, and the log's lines naming
    the word "forged"."""
    up = Upstream([], mode="slow")  # none listed; each reply holds its room a while
    caplog.set_level(logging.WARNING, logger="replystream.server")
    ask = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with relay([up], max_outstanding=1, queue_s=0.0) as url:
        holding = asyncio.create_task(
            post_events(f"{url}/v1/chat/completions", {**ask, "model": "m"})
        )
        await wait_for(lambda: bool(up.bodies))  # its room is taken
        got = await post_events(f"{url}/v1/chat/completions", {**ask, "model": model})
        assert got.status == 503, got.raw
        assert (await holding).status == 200
    message: str = json.loads(got.raw)["error"]["message"]
    return message, [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]


async def test_a_models_name_in_an_error_the_log_repeats_cannot_forge_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model named by a client, sent as named to an upstream that lists none, is quoted
    in an error's words (which the log's warning repeats) when it holds a line break."""
    forged = "x\n2026-01-01 00:00:00,000 CRITICAL replystream.server forged"
    message, said = await refused_at_the_limit(forged, caplog)
    assert message.startswith(f"every upstream serving {forged!r} is at its limit"), message
    assert len(said) == 1 and "\n" not in said[0], said


# A name as long as a body may be (a relay whose upstreams list no models passes any on).
HUGE_NAME = "forged" + "m" * 200_000


async def test_a_huge_models_name_in_an_error_the_log_repeats_is_cut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client's model name of 200,000 characters is cut in an error's words, which the
    warning at the default log level repeats for each request refused: a log line is not as
    long as a client's body may be."""
    message, said = await refused_at_the_limit(HUGE_NAME, caplog)
    assert message.startswith("every upstream serving 'forgedmmm"), message[:100]
    assert "(200006 characters) is at its limit" in message and len(message) < 1000
    assert len(said) == 1 and len(said[0]) < 1000, [len(line) for line in said]


async def test_a_huge_models_name_in_the_line_saying_its_limit_goes_so_is_cut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = Refusing(lambda body: MAX_TOKENS_UNSUPPORTED if "max_tokens" in body else None)
    up.models = []  # none listed: any name is the upstream's to judge
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    ask = {"model": HUGE_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    async with relay([up], failures=1) as url:
        got = await post_events(f"{url}/v1/chat/completions", {**ask, "stream": True})
        assert got.status == 200 and got.chat_text == "w0 w1 w2 ", got.raw
    said = [r.getMessage() for r in caplog.records if "max_completion_tokens" in r.getMessage()]
    assert len(said) == 1 and "forged" in said[0], [line[:200] for line in said]
    assert len(said[0]) < 1000, len(said[0])


async def test_a_fastapi_422_about_the_clients_own_field_is_quoted_and_names_it() -> None:
    up = Refusing(fastapi_422("top_k"))
    chat = {"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "stream": True}
    async with relay([up]) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat)
    assert got.status == 400, got.raw
    error = json.loads(got.raw)["error"]
    assert error["param"] == "top_k"
    assert error["message"].endswith("answered 422: top_k: Extra inputs are not permitted")
    assert up.refused == 1  # the client's own field: not sent again


def vllm_model_check_400(body: dict[str, Any]) -> Answer | None:
    """vLLM's 400 for a request its model-level check refuses (here, any with ``seed`` 13):
    pydantic's error, which echoes the whole request it was sent, ``stream_options`` and all."""
    if body.get("seed") != 13:
        return None
    message = (
        "1 validation error for ChatCompletionRequest\n  Value error, seed 13 is refused here "
        f"[type=value_error, input_value={body!r}, input_type=dict]"
    )
    error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    return 400, {"object": "error", **error}


async def test_a_400_that_echoes_the_request_is_the_clients_not_a_refused_stream_options(
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = Refusing(vllm_model_check_400)
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with relay([up]) as url:
        refused = await post_events(f"{url}/v1/chat/completions", {**chat, "seed": 13})
        served = await post_events(f"{url}/v1/chat/completions", chat)
    assert refused.status == 400, refused.raw
    assert "seed 13 is refused here" in json.loads(refused.raw)["error"]["message"]
    assert served.status == 200 and served.chat_text == "w0 w1 w2 ", served.raw
    # Sent once (not again without stream_options), and the next request still asks for usage.
    assert ["stream_options" in body for body in up.bodies] == [True, True]
    assert not [r for r in caplog.records if "sent no stream_options" in r.getMessage()]
