"""``POST /v1/responses`` takes null for the fields OpenAI's spec lets be null, as their
default: the openai SDK sends ``store=None`` (its types say ``Optional[bool]``) as null."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from replystream.server import create_app, running
from tests.conftest import fast_engine


@pytest.mark.parametrize("field", ["stream", "store", "background"])
async def test_a_null_flag_is_its_default(field: str) -> None:
    engine = fast_engine(reply_text="one two three")
    async with (
        running(create_app(engine)) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        kwargs = {"model": "simulated", "input": "count", "max_output_tokens": 2, field: None}
        response = await client.responses.create(**kwargs)  # type: ignore[call-overload]
        assert (response.status, response.output_text) == ("incomplete", "one two ")
        assert response.store is True  # the default, echoed
        assert response.background is False
        # Stored, as the default says: it can be read back.
        again = await client.responses.retrieve(response.id)
        assert again.output_text == response.output_text


async def test_null_stream_options_needs_no_stream() -> None:
    # Null is no options at all: a whole response, whatever ``stream`` says.
    async with running(create_app(fast_engine(reply_text="one two"))) as url:
        body = {"input": "count", "stream": None, "stream_options": None}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/responses", json=body) as answer,
        ):
            assert answer.status == 200
            assert (await answer.json())["status"] == "completed"
