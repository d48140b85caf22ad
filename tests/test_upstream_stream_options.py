"""An upstream that refuses ``stream_options``, which the relay adds to every request to have
the upstream's own usage: Azure OpenAI's older API versions answer 400 "Unrecognized request
argument supplied: stream_options", servers whose schema forbids fields they do not know
answer FastAPI's 422. The client never sent that field: its request is sent again without
it, then every request to that upstream goes without it and its usage is counted by the
relay. Also: a FastAPI 422 about a field the client did send is quoted and names it.
Real aiohttp upstreams on loopback ports, replystream serving an ``UpstreamEngine``."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from aiohttp import web

from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, relay

# Azure OpenAI's answers, API versions before 2024-10-21: in words alone, then with its param.
AZURE_400 = {
    "error": {
        "message": "Unrecognized request argument supplied: stream_options",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
}
UNKNOWN_PARAMETER_400 = {
    "error": {
        "message": "Unknown parameter: 'stream_options'.",
        "type": "invalid_request_error",
        "param": "stream_options",
        "code": "unknown_parameter",
    }
}


def fastapi_422(field: str, body: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's answer to a body with a field its model forbids (``extra="forbid"``)."""
    return {
        "detail": [
            {
                "type": "extra_forbidden",
                "loc": ["body", field],
                "msg": "Extra inputs are not permitted",
                "input": body[field],
            }
        ]
    }


class Refusing(Upstream):
    """An upstream that answers ``refusal(body)`` (a status and a JSON body) to a request
    holding ``field``, and streams as ``Upstream`` does to one without it."""

    def __init__(self, field: str, status: int, shape: str) -> None:
        super().__init__(["m"])
        self.field, self.status, self.shape = field, status, shape

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.field in body:
            self.bodies.append(body)
            answers = {"azure": AZURE_400, "unknown_parameter": UNKNOWN_PARAMETER_400}
            answer = answers.get(self.shape) or fastapi_422(self.field, body)
            return web.json_response(answer, status=self.status)
        return await super().chat(request)


@pytest.mark.parametrize(
    ("status", "shape"), [(400, "azure"), (400, "unknown_parameter"), (422, "fastapi")]
)
async def test_an_upstream_refusing_stream_options_is_sent_none_and_usage_is_counted_here(
    status: int, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    up = Refusing("stream_options", status, shape)
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
            assert usage["completion_tokens"] == 3  # the relay's count: the upstream sent none
            assert usage["prompt_tokens"] > 0
    # Refused once; sent again without it at once, and never again with it.
    assert ["stream_options" in body for body in up.bodies] == [True, False, False, False]
    warnings = [r.getMessage() for r in caplog.records if "stream_options" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "sent no stream_options from now on" in warnings[0]


async def test_a_fastapi_422_about_the_clients_own_field_is_quoted_and_names_it() -> None:
    up = Refusing("top_k", 422, "fastapi")
    chat = {"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "stream": True}
    async with relay([up]) as url:
        got = await post_events(f"{url}/v1/chat/completions", chat)
    assert got.status == 400, got.raw
    error = json.loads(got.raw)["error"]
    assert error["param"] == "top_k"
    assert error["message"].endswith("answered 422: top_k: Extra inputs are not permitted")
    assert len(up.bodies) == 1  # the client's own field: not sent again
