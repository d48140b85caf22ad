"""The openai SDK against the built-in transformer: sampling fields reach the model."""

import openai
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from replystream.engine.tiny import load_default_engine
from replystream.server import create_app, running

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "And the LORD said unto Moses,"}
]


async def sample(
    sdk: openai.AsyncOpenAI, seed: int, stop: list[str] | None = None
) -> ChatCompletion:
    return await sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=0.8,
        top_p=0.9,
        seed=seed,
        max_tokens=24,
        stop=stop,
    )


async def test_seeded_sampling_streams_the_same_text_it_returns_whole_and_stops_on_stop():
    engine = load_default_engine()
    async with running(create_app(engine)) as url:
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with sdk:
            whole = await sample(sdk, 11)
            stream = await sdk.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                temperature=0.8,
                top_p=0.9,
                seed=11,
                max_tokens=24,
                stream=True,
            )
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
            other_seed = await sample(sdk, 12)
            text = whole.choices[0].message.content or ""
            word = text.split()[2]
            stopped = await sample(sdk, 11, stop=[word])
    assert text and streamed == text
    assert other_seed.choices[0].message.content != text
    assert stopped.choices[0].finish_reason == "stop"
    assert word not in (stopped.choices[0].message.content or "")
    assert engine.scheduler_stats().kv.used_blocks == 0


async def test_top_p_0_is_accepted_as_openai_allows_and_picks_greedily():
    async with running(create_app(load_default_engine())) as url:
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with sdk:
            greedy = await sdk.chat.completions.create(
                model="tiny", messages=MESSAGES, temperature=0, max_tokens=24
            )
            texts = set()
            for seed in (1, 2, 3):
                nucleus = await sdk.chat.completions.create(
                    model="tiny",
                    messages=MESSAGES,
                    temperature=1.5,
                    top_p=0,
                    seed=seed,
                    max_tokens=24,
                )
                texts.add(nucleus.choices[0].message.content)
            legacy = await sdk.completions.create(
                model="tiny", prompt="And the LORD said unto Moses,", top_p=0, max_tokens=24
            )
            legacy_greedy = await sdk.completions.create(
                model="tiny", prompt="And the LORD said unto Moses,", temperature=0, max_tokens=24
            )
    assert texts == {greedy.choices[0].message.content}  # whatever the seed
    assert legacy.choices[0].text == legacy_greedy.choices[0].text
