"""A request waiting for the engine's scheduler, in the metrics: its time in the queue ends
when the engine takes it up, for a reply collected whole as for a stream, and a request whose
client left while it waited read none of its prompt (per-key prompt tokens)."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import wait_for
from tests.test_responses_queued import one_at_a_time, running_first


async def scrape(client: openai.AsyncOpenAI) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(str(client.base_url).replace("/v1/", "/metrics")) as answer:
            return await answer.text()


def reading(metrics: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.MULTILINE)
    return float(found[1]) if found else 0.0


QUEUE_SUM = 'replystream_queue_seconds_sum{endpoint="/v1/chat/completions"}'
PROMPT = 'replystream_key_tokens_total{key="anonymous",kind="prompt"}'
WAIT_S = 0.3


async def test_a_whole_reply_waiting_for_the_scheduler_counts_its_time_in_the_queue() -> None:
    async with one_at_a_time() as (client, engine, gate):
        await running_first(client)
        whole = asyncio.create_task(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4
            )
        )
        await wait_for(lambda: engine.scheduler_stats().waiting == 1)
        await asyncio.sleep(WAIT_S)
        gate.open.set()
        assert (await whole).choices[0].message.content
        waited = reading(await scrape(client), QUEUE_SUM)
    assert waited >= WAIT_S


async def test_a_request_whose_client_left_while_it_waited_counts_no_prompt_tokens() -> None:
    async with one_at_a_time() as (client, engine, gate):
        await running_first(client)
        before = reading(await scrape(client), PROMPT)
        long_prompt: list[ChatCompletionMessageParam] = [{"role": "user", "content": "y " * 200}]
        whole = asyncio.create_task(
            client.chat.completions.create(model="tiny", messages=long_prompt)
        )
        await wait_for(lambda: engine.scheduler_stats().waiting == 1)
        whole.cancel()  # the client leaves while the engine keeps it waiting
        await wait_for(lambda: engine.scheduler_stats().waiting == 0)
        stream = await client.chat.completions.create(  # (its head came)
            model="tiny", messages=long_prompt, stream=True
        )
        await wait_for(lambda: engine.scheduler_stats().waiting == 1)
        await stream.close()
        await wait_for(lambda: engine.scheduler_stats().waiting == 0)
        metrics = await scrape(client)
        gate.open.set()
    assert 'replystream_replies_total{endpoint="/v1/chat/completions",outcome="cancelled"} 2.0' in (
        metrics
    )
    assert reading(metrics, PROMPT) == before
