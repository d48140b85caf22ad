"""``stream_options`` on the OpenAI routes, over a real server: the usage chunk comes only when
asked, in OpenAI's shape, and an option this server cannot honour is refused."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from replystream.server import create_app, running
from tests.conftest import fast_engine
from tests.sse_client import post_events

REPLY = "one two three four five six"
CHAT: dict[str, Any] = {
    "model": "simulated",
    "messages": [{"role": "user", "content": "count"}],
    "max_tokens": 4,
}
LEGACY: dict[str, Any] = {"model": "simulated", "prompt": "count", "max_tokens": 4}


def chunks_of(events: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in events if e.data != "[DONE]"]


@pytest.mark.parametrize(
    ("path", "ask"), [("/v1/chat/completions", CHAT), ("/v1/completions", LEGACY)]
)
async def test_the_usage_chunk_comes_only_when_asked(path: str, ask: dict[str, Any]):
    async with running(create_app(fast_engine(reply_text=REPLY))) as url:
        plain = await post_events(url + path, {**ask, "stream": True})
        asked = await post_events(
            url + path, {**ask, "stream": True, "stream_options": {"include_usage": True}}
        )
        declined = await post_events(
            url + path, {**ask, "stream": True, "stream_options": {"include_usage": False}}
        )
    for got in (plain, declined):
        chunks = chunks_of(got.events)
        assert all("usage" not in c and c["choices"] for c in chunks)
        assert got.events[-1].data == "[DONE]"
    chunks = chunks_of(asked.events)
    assert asked.events[-1].data == "[DONE]"
    last = chunks[-1]
    assert last["choices"] == []
    usage = last["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert all(c["usage"] is None and c["choices"] for c in chunks[:-1])


async def test_the_sdk_reads_the_usage_chunk_as_the_non_streamed_usage():
    async with (
        running(create_app(fast_engine(reply_text=REPLY))) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        whole = await client.completions.create(**LEGACY)
        stream = await client.completions.create(
            **LEGACY, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                **CHAT, stream=True, stream_options={"include_obfuscation": True}
            )
        allowed = await client.chat.completions.create(
            **CHAT, stream=True, stream_options={"include_obfuscation": False}
        )
        assert [c async for c in allowed][-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert refused.value.param == "stream_options.include_obfuscation"
