"""Log probabilities on ``POST /v1/responses``, read with the official openai SDK from a real
server: ``include: ["message.output_text.logprobs"]`` shows them, ``top_logprobs`` says how
many alternatives each lists; streamed, whole, stored and read back, resumed, and relayed from
an upstream that has none."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from replystream.engine.reply_script import parse_reply_script
from replystream.engine.simulated import SimulatedConfig, simulated_engine
from replystream.engine.tiny import load_default_engine
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.sse import EventParser
from tests.chat_upstream import ChatUpstream, reply_with
from tests.conftest import fast_engine, our_code

REPLY = "one two three four five"  # five tokens, five different words
INCLUDE: Any = ["message.output_text.logprobs"]
SEEDED = {"replystream": {"seed": 11}}


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def entries(logprobs: Any) -> list[dict[str, Any]]:
    return [entry.model_dump() for entry in logprobs]


def without_bytes(listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "token": entry["token"],
            "logprob": entry["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]
            ],
        }
        for entry in listed
    ]


async def streamed(client: openai.AsyncOpenAI, **ask: Any) -> list[Any]:
    ask = {"model": "simulated", "input": "count", **ask}
    stream = await client.responses.create(stream=True, **ask)
    return [event async for event in stream]


def of_type(events: list[Any], kind: str) -> list[Any]:
    return [event for event in events if event.type == kind]


@pytest.mark.parametrize("top", [0, 5, 20])
async def test_included_logprobs_are_in_each_delta_the_done_event_and_the_output_text(top):
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        ask: dict[str, Any] = {"include": INCLUDE, "top_logprobs": top, "extra_body": SEEDED}
        events = await streamed(client, **ask)
        whole = await client.responses.create(model="simulated", input="count", store=False, **ask)
        chat = await client.chat.completions.create(
            model="simulated",
            messages=[{"role": "user", "content": "count"}],
            logprobs=True,
            top_logprobs=top,
            seed=11,
        )
    deltas = of_type(events, "response.output_text.delta")
    assert [delta.delta for delta in deltas] == [f"{word} " for word in REPLY.split()]
    for delta in deltas:  # one token each: its own entry, the likeliest tokens after it
        [entry] = delta.logprobs
        assert entry.token == delta.delta
        assert len(entry.top_logprobs) == min(top, 5)  # "fewer than requested": five words
        assert entry.top_logprobs[:1] == ([] if top == 0 else [entry.top_logprobs[0]])
    [done] = of_type(events, "response.output_text.done")
    told = [entry for delta in deltas for entry in entries(delta.logprobs)]
    assert entries(done.logprobs) == told
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.top_logprobs == top
    [part] = completed.response.output[0].content
    listed = entries(part.logprobs)
    assert without_bytes(listed) == told
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in listed)
    # The same part wherever it is told, whole too; and the numbers chat gives the same ask.
    [part_done] = of_type(events, "response.content_part.done")
    [item_done] = of_type(events, "response.output_item.done")
    assert part_done.part == part == item_done.item.content[0]
    assert whole.output[0].content[0] == part
    assert chat.choices[0].logprobs is not None
    assert entries(chat.choices[0].logprobs.content) == listed


@pytest.mark.parametrize("top", [None, 0, 5])
async def test_without_include_the_output_shows_no_logprobs_whatever_top_logprobs_says(top):
    ask: dict[str, Any] = {} if top is None else {"top_logprobs": top}
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        events = await streamed(client, **ask)
        whole = await client.responses.create(model="simulated", input="count", **ask)
    assert [delta.logprobs for delta in of_type(events, "response.output_text.delta")] == [[]] * 5
    assert [done.logprobs for done in of_type(events, "response.output_text.done")] == [[]]
    for response in (events[-1].response, whole):
        assert response.output_text == REPLY + " "
        assert response.output[0].content[0].logprobs == []  # there, as OpenAI's parts have it
        assert response.top_logprobs == (top or 0)


async def test_the_tiny_models_logprobs_are_the_ones_chat_gives_for_the_same_ask():
    # A real model's own distribution, through each dialect's code from the same engine.
    said = "And the LORD said unto Moses,"
    async with running(create_app(load_default_engine())) as url, sdk(url) as client:
        events = await streamed(
            client,
            model="tiny",
            input=said,
            temperature=0,
            max_output_tokens=12,
            include=INCLUDE,
            top_logprobs=5,
        )
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": said}],
            temperature=0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=5,
        )
    response = events[-1].response
    [part] = response.output[0].content
    assert chat.choices[0].logprobs is not None
    assert entries(part.logprobs) == entries(chat.choices[0].logprobs.content)
    assert part.text == chat.choices[0].message.content and len(part.logprobs) == 12
    deltas = of_type(events, "response.output_text.delta")
    assert [e for d in deltas for e in entries(d.logprobs)] == without_bytes(entries(part.logprobs))


async def test_batched_text_cut_at_a_stop_string_lists_the_tokens_of_each_delta():
    extensions = {"replystream": {"seed": 11, "batch_tokens": 2, "stop": ["four"]}}
    ask: dict[str, Any] = {"include": INCLUDE, "extra_body": extensions}
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        events = await streamed(client, **ask)
    deltas = of_type(events, "response.output_text.delta")
    assert "".join(delta.delta for delta in deltas) == "one two three "
    for delta in deltas:  # each its own tokens, whatever was batched with it
        assert "".join(entry.token for entry in delta.logprobs) == delta.delta
    assert [len(delta.logprobs) for delta in deltas] == [2, 1]
    [part] = events[-1].response.output[0].content
    assert [entry.token for entry in part.logprobs] == ["one ", "two ", "three "]


@pytest.mark.parametrize(
    ("field", "value", "param", "code"),
    [
        ("top_logprobs", -1, "top_logprobs", "invalid_value"),
        ("top_logprobs", 21, "top_logprobs", "invalid_value"),
        ("top_logprobs", 2.5, "top_logprobs", "invalid_value"),
        ("top_logprobs", "5", "top_logprobs", "invalid_value"),
        ("top_logprobs", True, "top_logprobs", "invalid_value"),
        ("include", [*INCLUDE, "file_search_call.results"], "include", "unsupported_parameter"),
        ("include", ["message.output_text"], "include", "unsupported_parameter"),
        ("include", "message.output_text.logprobs", "include", "unsupported_parameter"),
    ],
)
async def test_a_bad_top_logprobs_or_include_is_a_400_naming_it(field, value, param, code):
    body = {"input": "x", "include": INCLUDE, field: value}
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=body) as response:
            error = (await response.json())["error"]
            assert response.status == 400, error
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


async def test_a_stored_response_is_read_back_and_resumed_with_its_logprobs():
    ask = {"input": "count", "stream": True, "include": INCLUDE, "top_logprobs": 3, **SEEDED}
    async with (
        running(create_app(fast_engine(reply_text=REPLY))) as url,
        sdk(url) as client,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{url}/v1/responses", json=ask) as response:
            whole = EventParser().feed(await response.read())
        events = [(event.type, event.data) for event in whole]
        response_id = "resp_" + response.headers["X-Reply-Id"]
        for after in (0, 4, 6, len(events) - 2):  # sequence numbers, from 0
            query = {"stream": "true", "starting_after": str(after)}
            async with http.get(f"{url}/v1/responses/{response_id}", params=query) as again:
                rest = [
                    (event.type, event.data) for event in EventParser().feed(await again.read())
                ]
            assert rest == events[after + 1 :]  # byte for byte, logprobs and all
        read_back: Any = await client.responses.retrieve(response_id, include=INCLUDE)
        not_included: Any = await client.responses.retrieve(response_id)
        replayed: list[Any] = [
            e async for e in await client.responses.retrieve(response_id, stream=True)
        ]
    completed = replayed[-1].response
    assert read_back == completed
    # Read back without asking for them, the object shows none, as one made without them.
    assert not_included.output[0].content[0].logprobs == []
    assert not_included.output_text == read_back.output_text
    [part] = read_back.output[0].content
    assert part.logprobs is not None and len(part.logprobs) == 5
    assert all(len(entry.top_logprobs) == 3 for entry in part.logprobs)
    deltas = of_type(replayed, "response.output_text.delta")
    told = [entry for delta in deltas for entry in entries(delta.logprobs)]
    assert without_bytes(entries(part.logprobs)) == told


async def test_a_long_replys_logprobs_are_the_same_streamed_stored_and_whole_byte_for_byte():
    """Forty tokens: their entries written as they came and joined for the last events, and
    made in slices for a whole one; a stored response read back is its terminal event's
    object, byte for byte (not parsed and written again)."""
    long_reply = " ".join(f"w{i}" for i in range(40))
    ask = {"input": "count", "include": INCLUDE, "top_logprobs": 4, **SEEDED}
    async with (
        running(create_app(fast_engine(reply_text=long_reply))) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{url}/v1/responses", json={**ask, "stream": True}) as response:
            events = {e.type: e.data for e in EventParser().feed(await response.read())}
            response_id = "resp_" + response.headers["X-Reply-Id"]
        asked = {"include[]": INCLUDE[0]}
        async with http.get(f"{url}/v1/responses/{response_id}", params=asked) as read_back:
            stored = await read_back.text()
        async with http.post(f"{url}/v1/responses", json=ask) as blocking:
            waited = await blocking.json()
        async with http.post(f"{url}/v1/responses", json={**ask, "store": False}) as whole:
            unstored = await whole.json()
    completed = events["response.completed"]
    assert completed.endswith("," + '"response":' + stored + "}")
    part = json.loads(stored)["output"][0]["content"][0]
    assert len(part["logprobs"]) == 40 and part["logprobs"][39]["token"] == "w39 "
    assert all(len(entry["top_logprobs"]) == 4 for entry in part["logprobs"])
    assert json.loads(events["response.content_part.done"])["part"] == part
    done = json.loads(events["response.output_text.done"])
    assert done["logprobs"] == without_bytes(part["logprobs"])
    for other in (waited, unstored):  # the same seed: the same tokens, other ids
        assert other["output"][0]["content"][0] == part


async def test_cancelling_an_ended_background_response_answers_its_object_as_written():
    """Its standing is read from its first and last events: the answer is the stored
    object, byte for byte as a GET has it; a streamed one is still refused (400)."""
    ask = {"input": "count", "include": INCLUDE, "top_logprobs": 4, **SEEDED}
    async with (
        running(create_app(fast_engine(reply_text=REPLY))) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{url}/v1/responses", json={**ask, "background": True}) as queued:
            response_id = (await queued.json())["id"]
        asked = {"include[]": INCLUDE[0]}
        async with asyncio.timeout(30):  # five tokens: it ends at once
            while True:
                got = http.get(f"{url}/v1/responses/{response_id}", params=asked)
                async with got as read_back:
                    stored = await read_back.text()
                if json.loads(stored)["status"] == "completed":
                    break
                await asyncio.sleep(0.01)
        async with http.post(f"{url}/v1/responses/{response_id}/cancel") as cancelled:
            assert cancelled.status == 200
            assert await cancelled.text() == stored
        async with http.post(f"{url}/v1/responses", json={**ask, "stream": True}) as streamed:
            await streamed.read()
            streamed_id = "resp_" + streamed.headers["X-Reply-Id"]
        async with http.post(f"{url}/v1/responses/{streamed_id}/cancel") as refused:
            assert refused.status == 400
            assert (await refused.json())["error"]["param"] == "response_id"
    part = json.loads(stored)["output"][0]["content"][0]
    assert len(part["logprobs"]) == 5


async def test_each_message_around_a_tool_call_has_its_own_tokens_logprobs_streamed_and_whole():
    steps = [
        {"text": "Let "},
        {"text": "me "},
        {"tool_call": {"name": "look", "id": "call_1", "arguments": ['{"q":', ' "x"}']}},
        {"text": "Done "},
    ]
    engine = simulated_engine(
        SimulatedConfig(delay_ms=5.0, jitter_ms=1.0, script=parse_reply_script(steps))
    )
    ask: dict[str, Any] = {"include": INCLUDE, "top_logprobs": 2}
    async with running(create_app(engine)) as url, sdk(url) as client:
        events = await streamed(client, **ask)
        whole = await client.responses.create(model="simulated", input="count", store=False, **ask)
    for response in (events[-1].response, whole):
        kinds = [item.type for item in response.output]
        assert kinds == ["message", "function_call", "message"]
        first, second = response.output[0].content[0], response.output[2].content[0]
        assert [entry.token for entry in first.logprobs] == ["Let ", "me "]
        assert [entry.token for entry in second.logprobs] == ["Done "]
    assert [item.content[0] for item in whole.output if item.type == "message"] == [
        item.content[0] for item in events[-1].response.output if item.type == "message"
    ]
    dones = of_type(events, "response.output_text.done")
    assert [[entry.token for entry in done.logprobs] for done in dones] == [
        ["Let ", "me "],
        ["Done "],
    ]


@pytest.mark.parametrize("store", [False, True])
async def test_an_output_with_logprobs_can_be_sent_back_as_input(store):
    # Stored, the input is kept as given (logprobs too) and read again to continue from it.
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        first: Any = await client.responses.create(
            model="simulated", input="count", store=False, include=INCLUDE
        )
        assert first.output[0].content[0].logprobs  # the part sent back carries them
        history: list[Any] = [{"role": "user", "content": "count"}]
        history += [item.model_dump(exclude_none=True) for item in first.output]
        second = await client.responses.create(
            model="simulated", input=[*history, {"role": "user", "content": "again"}], store=store
        )
        assert second.status == "completed"
        if store:
            third = await client.responses.create(
                model="simulated", input="more", previous_response_id=second.id
            )
            assert third.status == "completed"


class NoLogprobsUpstream(ChatUpstream):
    """An upstream that answers with text alone, whatever the request asks (as one without
    log probabilities does), and keeps the bodies it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        return await reply_with(request, "plain text")


@asynccontextmanager
async def relay_to(upstream: ChatUpstream) -> AsyncIterator[str]:
    async with running(upstream.app()) as upstream_url:
        config = UpstreamConfig((UpstreamTarget(f"{upstream_url}/v1"),), model="m")
        async with running(create_app(UpstreamEngine(config))) as url:
            yield url


async def test_a_relay_asks_its_upstream_and_fails_as_chat_does_when_it_has_none():
    upstream = NoLogprobsUpstream()
    async with relay_to(upstream) as url, sdk(url) as client:
        ask: dict[str, Any] = {"model": "m", "input": "hi", "include": INCLUDE, "top_logprobs": 4}
        stream = await client.responses.create(**ask, stream=True)
        events = [event async for event in stream]
        whole = await client.responses.create(**ask, store=False)
        plain = await client.responses.create(model="m", input="hi", top_logprobs=4)
        chat = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=4,
            stream=True,
        )
        with pytest.raises(openai.APIError) as chat_error:
            async for _ in chat:
                pass
    sent = [(body.get("logprobs"), body.get("top_logprobs")) for body in upstream.bodies]
    assert sent == [(True, 4), (True, 4), (None, None), (True, 4)]  # not included: not asked
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.response.error is not None and whole.error is not None
    assert our_code(failed.response.error) == our_code(whole.error) == chat_error.value.code
    assert chat_error.value.code == "upstream_no_logprobs"
    assert whole.status == "failed"
    assert plain.status == "completed" and plain.output_text == "plain text"


async def test_an_unstored_stream_and_a_background_response_show_them_too():
    ask: dict[str, Any] = {"include": INCLUDE, "top_logprobs": 1, "extra_body": SEEDED}
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        events = await streamed(client, store=False, **ask)
        queued = await client.responses.create(
            model="simulated", input="count", background=True, **ask
        )
        for _ in range(200):
            done: Any = await client.responses.retrieve(queued.id, include=INCLUDE)
            if done.status == "completed":
                break
            await asyncio.sleep(0.02)
    parts = [events[-1].response.output[0].content[0], done.output[0].content[0]]
    assert parts[0] == parts[1]
    assert parts[0].logprobs is not None and len(parts[0].logprobs) == 5


async def test_a_retrieved_response_shows_its_logprobs_only_when_the_retrieve_includes_them():
    # OpenAI's retrieve takes ``include`` as its create does: the object shows log
    # probabilities only when asked, whatever its request included.
    async with (
        running(create_app(fast_engine(reply_text=REPLY))) as url,
        sdk(url) as client,
        aiohttp.ClientSession() as http,
    ):
        made = await client.responses.create(
            model="simulated", input="count", include=INCLUDE, top_logprobs=2
        )
        plain = await client.responses.create(model="simulated", input="count")
        included: Any = await client.responses.retrieve(made.id, include=INCLUDE)
        not_included: Any = await client.responses.retrieve(made.id)
        none_made: Any = await client.responses.retrieve(plain.id, include=INCLUDE)
        async with http.get(f"{url}/v1/responses/{made.id}") as raw:
            text = await raw.text()
        with pytest.raises(openai.BadRequestError) as with_stream:
            await client.responses.retrieve(made.id, stream=True, include=INCLUDE)
    assert included == made
    assert len(included.output[0].content[0].logprobs) == 5
    # Not included: the object a response made without them shows, its text and all else alike.
    assert not_included.output[0].content[0].logprobs == []
    assert not_included.model_dump(exclude={"output"}) == made.model_dump(exclude={"output"})
    assert not_included.output_text == made.output_text
    assert json.loads(text)["output"][0]["content"][0]["logprobs"] == []
    # Asked of a response made without them: there are none to show.
    assert none_made.output[0].content[0].logprobs == []
    # A stream replays its events as they were made: include is refused there, not ignored.
    refused: Any = with_stream.value.body
    assert (refused["param"], refused["code"]) == ("include", "unsupported_parameter")
