"""A refusal of one of replystream's own fields names it where the client put it: under
``replystream`` on the Responses and Messages routes, which have no such top-level field."""

from __future__ import annotations

from typing import Any

import aiohttp

from replystream.server import create_app, running
from tests.conftest import fast_engine


async def _refusal(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as answer:
        assert answer.status == 400, await answer.text()
        error: dict[str, Any] = (await answer.json())["error"]
        return error


async def test_min_tokens_past_the_limit_names_it_under_replystream() -> None:
    async with running(create_app(fast_engine())) as url:
        responses = await _refusal(
            url,
            "/v1/responses",
            {"input": "count", "max_output_tokens": 2, "replystream": {"min_tokens": 3}},
        )
        messages = await _refusal(
            url,
            "/v1/messages",
            {
                "model": "simulated",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "count"}],
                "replystream": {"min_tokens": 3},
            },
        )
        chat = await _refusal(
            url,
            "/v1/chat/completions",
            {"max_tokens": 2, "min_tokens": 3, "messages": [{"role": "user", "content": "count"}]},
        )
    assert responses["param"] == "replystream.min_tokens"
    # The limit is named as no dialect's field in particular: this one's is max_output_tokens.
    assert "the reply's token limit (2)" in responses["message"], responses
    assert "max_tokens" not in responses["message"], responses
    assert (messages["type"], messages["param"]) == (
        "invalid_request_error",
        "replystream.min_tokens",
    )
    assert chat["param"] == "min_tokens"  # chat's own top-level field
