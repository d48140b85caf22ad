"""The tiny engine behind the real server: a reply in words, a refusal before any byte."""

from __future__ import annotations

import aiohttp

from replystream.engine.tiny import load_default_engine
from replystream.server import create_app, running


async def test_server_replies_in_words_from_the_tiny_engine() -> None:
    engine = load_default_engine()
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as session:
        query = {"prompt": "And the LORD said unto Moses,", "max_tokens": "20", "seed": "3"}
        async with session.get(f"{url}/wait", params=query) as response:
            assert response.status == 200
            text = (await response.json())["text"]
        async with session.get(f"{url}/wait", params={"prompt": "amen " * 400}) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert len(text.split()) >= 8
    assert error["param"] == "prompt"
    assert engine.stats().finished == 1
    assert engine.scheduler_stats().kv.used_blocks == 0
