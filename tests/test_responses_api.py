"""``POST /v1/responses`` with the official openai SDK, unchanged, and over raw SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Final

import aiohttp
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from replystream.delivery.replay import MemoryReplayStore, ReadResult
from replystream.server import create_app, running
from replystream.server.context import MANAGER_KEY
from replystream.server.responses_stored import NO_SUCH_RESPONSE
from replystream.server.server_config import ServerConfig
from replystream.sse import EventParser
from tests.conftest import fast_engine, our_code, wait_for

REPLY = "one two three four five six seven eight nine ten"
LOGPROBS: Final = "message.output_text.logprobs"
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def sync_sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_streamed_text_equals_the_whole_response_and_usage_matches_the_engine():
    engine = fast_engine(reply_text=REPLY)
    ask = {"model": "simulated", "instructions": "be brief", "input": "count"}
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.responses.create(**ask)  # type: ignore[call-overload]
        stream = await client.responses.create(**ask, stream=True)  # type: ignore[call-overload]
        events = [event async for event in stream]
    assert (whole.object, whole.status, whole.model) == ("response", "completed", "simulated")
    assert whole.output_text == REPLY + " "
    assert whole.usage is not None
    prompt_tokens = engine.count_tokens("system: be brief\nuser: count")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (prompt_tokens, 10)
    kinds = [event.type for event in events]
    assert kinds == [*OPENING, *["response.output_text.delta"] * 10, *CLOSING, "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == text
    assert completed.response.usage == whole.usage
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_the_sync_client_reads_a_token_limit_as_an_incomplete_response():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url:

        def ask() -> tuple[openai.types.responses.Response, list[object]]:
            with sync_sdk(url) as client:
                whole = client.responses.create(
                    model="simulated", input="count", max_output_tokens=4
                )
                stream = client.responses.create(
                    model="simulated", input="count", max_output_tokens=4, stream=True
                )
                return whole, list(stream)

        whole, events = await asyncio.to_thread(ask)
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == "one two three four "
    last = events[-1]
    assert last.type == "response.incomplete"  # type: ignore[attr-defined]
    assert last.response.output_text == whole.output_text  # type: ignore[attr-defined]


async def test_every_event_names_its_type_and_sequence_numbers_count_from_zero():
    """OpenAI's numbering: ``response.created`` is 0. The SSE id (``Last-Event-ID``'s cursor)
    is the event's number in the reply log, one more."""
    engine = fast_engine(reply_text=REPLY)
    body = {"input": "count", "stream": True, "max_output_tokens": 3}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=body) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = await response.read()
    events = EventParser().feed(raw)
    assert b"[DONE]" not in raw
    numbers = []
    for event in events:
        data = json.loads(event.data)
        assert data["type"] == event.type
        assert data["sequence_number"] == int(event.id or "-1") - 1
        numbers.append(data["sequence_number"])
    assert numbers == list(range(len(events)))
    assert events[-1].type == "response.incomplete"


async def test_a_stored_response_resumes_after_any_sequence_number():
    engine = fast_engine(reply_text=REPLY)
    body = {"input": "count", "stream": True}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=body) as response:
            reply_id = response.headers["X-Reply-Id"]
            whole = EventParser().feed(await response.read())
        for after in (0, 4, 9, len(whole) - 1):
            headers = {"Last-Event-ID": str(after)}
            async with http.get(f"{url}/v1/replies/{reply_id}/stream", headers=headers) as again:
                rest = EventParser().feed(await again.read())
            assert [(e.type, e.data) for e in rest] == [(e.type, e.data) for e in whole[after:]]


async def test_an_engine_failure_mid_stream_ends_with_response_failed():
    engine = fast_engine(reply_text=REPLY, fail_after=3)
    async with running(create_app(engine)) as url, sdk(url) as client:
        stream = await client.responses.create(model="simulated", input="x", stream=True)
        events = [event async for event in stream]
    last = events[-1]
    assert last.type == "response.failed"
    assert last.response.status == "failed"
    assert last.response.error is not None
    assert our_code(last.response.error) == "generation_failed"
    assert [e.type for e in events].count("response.output_text.delta") == 3


@pytest.mark.parametrize("store", [True, False])
async def test_a_whole_response_that_fails_is_a_200_with_status_failed_stored_or_not(store: bool):
    # As OpenAI answers a response that failed once accepted, and alike whether it is kept:
    # the object, failed, with its error and the output made before the failure.
    engine = fast_engine(reply_text=REPLY, fail_after=3)
    async with running(create_app(engine)) as url, sdk(url) as client:
        failed = await client.responses.create(model="simulated", input="x", store=store)
    assert (failed.status, failed.model_dump()["store"], failed.usage) == ("failed", store, None)
    assert failed.error is not None
    assert our_code(failed.error) == "generation_failed"
    # OpenAI's code, so the object validates against the SDK's type (a Literal of its own).
    Response.model_validate(failed.model_dump())
    assert failed.output_text == "one two three "
    assert [item.model_dump()["status"] for item in failed.output] == ["incomplete"]


async def test_a_cancelled_response_ends_with_status_cancelled():
    engine = fast_engine(reply_text=REPLY * 20, delay_ms=20.0)
    app = create_app(engine)
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json={"input": "x", "stream": True}) as r:
            reply_id = r.headers["X-Reply-Id"]
            parser, events, cancelled = EventParser(), [], False
            async for chunk in r.content.iter_any():
                events += parser.feed(chunk)
                # At least six: on a loaded machine one read may bring several events.
                if len(events) >= 6 and not cancelled:
                    await http.post(f"{url}/v1/replies/{reply_id}/cancel")
                    cancelled = True
    final = json.loads(events[-1].data)
    assert final["type"] == "response.failed"
    assert final["response"]["status"] == "cancelled"
    assert final["response"]["error"] is None  # not an error: OpenAI's cancelled object
    await wait_for(lambda: engine.stats().active == 0)


async def test_the_item_a_failure_or_a_cancel_cuts_is_incomplete():
    # An output item is in_progress, completed or incomplete: never failed nor cancelled.
    failing = fast_engine(reply_text=REPLY, fail_after=3)
    async with running(create_app(failing)) as url, sdk(url) as client:
        stream = await client.responses.create(model="simulated", input="x", stream=True)
        events = [event async for event in stream]
        assert events[-1].type == "response.failed"
        failed = await client.responses.retrieve(events[-1].response.id)
    slow = fast_engine(reply_text=REPLY * 50, delay_ms=20.0)
    async with running(create_app(slow)) as url, sdk(url) as client:
        queued = await client.responses.create(model="simulated", input="x", background=True)
        following = await client.responses.retrieve(queued.id, stream=True)
        async for event in following:
            if event.type == "response.output_text.delta":
                break  # a message item is open
        cancelled = await client.responses.cancel(queued.id)
        await following.close()
        retrieved = await client.responses.retrieve(queued.id)
    for response, status in (
        (events[-1].response, "failed"),
        (failed, "failed"),
        (cancelled, "cancelled"),
        (retrieved, "cancelled"),
    ):
        assert response.status == status
        statuses = [(item.type, getattr(item, "status", None)) for item in response.output]
        assert statuses == [("message", "incomplete")]


async def test_the_fields_agent_frameworks_send_by_default_are_taken():
    # An empty include (what the openai Agents SDK sends when it wants nothing more), the
    # one stream option this server honours, and the fields chat also ignores.
    engine = fast_engine(reply_text=REPLY)
    defaults: Any = {
        "include": [],
        "tools": [],
        "service_tier": "auto",
        "safety_identifier": "user-1",
        "truncation": "disabled",
    }
    async with running(create_app(engine)) as url, sdk(url) as client:
        whole = await client.responses.create(model="simulated", input="x", **defaults)
        stream = await client.responses.create(
            model="simulated",
            input="x",
            stream=True,
            stream_options={"include_obfuscation": False},
            **defaults,
        )
        events = [event async for event in stream]
    assert whole.status == "completed" and whole.output_text == REPLY + " "
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == whole.output_text


async def test_encrypted_reasoning_a_client_keeping_the_conversation_asks_for_is_taken():
    # What Vercel's AI SDK sends for a reasoning model with store: false, then its next turn:
    # the output sent back whole, with a reasoning item of the kind OpenAI's model makes.
    engine = fast_engine(reply_text=REPLY)
    ask: Any = {"model": "simulated", "store": False, "include": ["reasoning.encrypted_content"]}
    async with running(create_app(engine)) as url, sdk(url) as client:
        first = await client.responses.create(input="count", **ask)
        stream = await client.responses.create(input="count", stream=True, **ask)
        events = [event async for event in stream]
        thought = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}
        told = [item.model_dump(exclude_none=True) for item in first.output]
        history: Any = [{"role": "user", "content": "count"}, thought, *told]
        second = await client.responses.create(
            input=[*history, {"role": "user", "content": "again"}], **ask
        )
    assert first.status == second.status == events[-1].response.status == "completed"
    assert first.output_text == events[-1].response.output_text == REPLY + " "
    assert [item.type for item in first.output] == ["message"]  # no thinking: nothing added


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "background": True, "store": False}, 400, "background"),
        ({"input": "x", "previous_response_id": "resp_abc"}, 400, "previous_response_id"),
        ({"input": "x", "previous_response_id": "chatcmpl-1"}, 400, "previous_response_id"),
        ({"input": 7}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, None),
        ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "temperature": 9}, 400, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "replystream": {"batch_tokens": 0}}, 400, "replystream.batch_tokens"),
        ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"input": "x", "model": "gpt-9"}, 404, "model"),
        ({"input": "x", "truncation": "auto"}, 400, "truncation"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text.format.name"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
        ({"input": "x", "text": {"verbosity": "loud"}}, 400, "text.verbosity"),
        ({"input": "x", "include": ["file_search_call.results"]}, 400, "include"),
        ({"input": "x", "include": "all"}, 400, "include"),
        ({"input": "x", "stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
        (
            {"input": "x", "stream": True, "stream_options": {"include_obfuscation": True}},
            400,
            "stream_options.include_obfuscation",
        ),
        ({"input": "x", "stream": True, "stream_options": {"include_usage": True}}, 400, None),
    ],
)
async def test_what_is_not_honoured_is_refused_naming_the_field(body, status, param):
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=body) as response:
            error = (await response.json())["error"]
            assert response.status == status, error
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error


async def test_the_text_format_and_truncation_it_echoes_are_accepted_as_sent():
    """A client that sends back the settings a response object shows (plain text, no
    truncation) is served, and its verbosity is repeated as the API repeats it."""
    async with running(create_app(fast_engine())) as url, sdk(url) as client:
        response = await client.responses.create(
            model="simulated",
            input="x",
            text={"format": {"type": "text"}, "verbosity": "low"},
            truncation="disabled",
        )
        again = await client.responses.retrieve(response.id)
    assert response.status == "completed" and response.truncation == "disabled"
    assert response.text is not None and response.text.format is not None
    assert (response.text.format.type, response.text.verbosity) == ("text", "low")
    assert again.text == response.text


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"truncation": "auto"}, "unsupported_parameter"),
        (
            {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}},
            "unsupported_parameter",
        ),
        ({"text": {"verbosity": "loud"}}, "invalid_value"),
    ],
)
async def test_a_setting_this_server_cannot_honour_is_unsupported_a_wrong_one_invalid(body, code):
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json={"input": "x", **body}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == code


async def test_a_background_response_runs_unread_and_resumes_after_any_sequence_number():
    engine = fast_engine(reply_text=REPLY, delay_ms=10.0)
    async with running(create_app(engine)) as url, sdk(url) as client:
        queued = await client.responses.create(model="simulated", input="count", background=True)
        assert (queued.status, queued.background) == ("queued", True)
        await wait_for(lambda: engine.stats().finished == 1)  # nobody read it meanwhile
        done = await client.responses.retrieve(queued.id)
        assert (done.status, done.output_text) == ("completed", REPLY + " ")
        whole = [e async for e in await client.responses.retrieve(queued.id, stream=True)]
        assert [e.sequence_number for e in whole] == list(range(len(whole)))
        for after in (0, 5, len(whole) - 2):
            rest = [
                e
                async for e in await client.responses.retrieve(
                    queued.id, stream=True, starting_after=after
                )
            ]
            assert [e.sequence_number for e in rest] == list(range(after + 1, len(whole)))
            assert rest == whole[after + 1 :]
    assert whole[0].type == "response.created" and whole[1].type == "response.queued"
    assert whole[-1].type == "response.completed"


async def test_cancel_is_idempotent_and_delete_forgets_the_response():
    engine = fast_engine(reply_text=REPLY * 50, delay_ms=20.0)
    async with running(create_app(engine)) as url, sdk(url) as client:
        queued = await client.responses.create(model="simulated", input="x", background=True)
        await wait_for(lambda: engine.stats().active == 1)
        cancelled = await client.responses.cancel(queued.id)
        again = await client.responses.cancel(queued.id)
        assert cancelled.status == again.status == "cancelled"
        assert cancelled.error is None
        await wait_for(lambda: engine.stats().active == 0)
        # Only a background response can be cancelled: a streamed one, running or not, is
        # a 400, and goes on.
        stream = await client.responses.create(model="simulated", input="x", stream=True)
        opened: Any = await anext(aiter(stream))
        streamed_id = opened.response.id
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.cancel(streamed_id)
        assert refused.value.body["param"] == "response_id"  # type: ignore[index]
        assert "background" in refused.value.body["message"]  # type: ignore[index]
        assert engine.stats().active == 1
        await stream.close()
        await client.responses.delete(queued.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(queued.id)


async def test_deleting_a_running_response_stops_it_and_leaves_nothing_behind(
    caplog: pytest.LogCaptureFixture,
):
    engine = fast_engine(reply_text=REPLY * 50, delay_ms=20.0)
    app = create_app(engine)
    async with running(app) as url, sdk(url) as client:
        queued = await client.responses.create(model="simulated", input="x", background=True)
        await wait_for(lambda: engine.stats().active == 1)
        await client.responses.delete(queued.id)
        # The producer stops, winds down into a log that is gone, and is done with.
        await wait_for(lambda: engine.stats().active == 0 and not app[MANAGER_KEY].replies)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(queued.id)
    assert engine.stats().cancelled == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_reply_of_another_dialect_is_no_response_on_any_route():
    engine = fast_engine(reply_text=REPLY)
    app = create_app(engine, ServerConfig(resumable_by_default=True))
    async with running(app) as url, aiohttp.ClientSession() as http:
        made: dict[str, tuple[str, dict[str, Any]]] = {
            "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            "native": ("/v1/replies", {"prompt": "x"}),
            "messages": (
                "/v1/messages",
                {
                    "model": "simulated",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "x"}],
                },
            ),
        }
        for path, body in made.values():
            async with http.post(f"{url}{path}", json={**body, "stream": True}) as started:
                assert started.status == 200, await started.text()
                reply_id = started.headers["X-Reply-Id"]
                await started.read()
            response = f"{url}/v1/responses/resp_{reply_id}"
            for method, where, query in (
                ("GET", response, {}),
                ("GET", response, {"stream": "true"}),
                ("POST", f"{response}/cancel", {}),
                ("DELETE", response, {}),
                ("GET", f"{response}/input_items", {}),
            ):
                async with http.request(method, where, params=query) as refused:
                    assert refused.status == 404, (path, method, query, await refused.text())
                    error = (await refused.json())["error"]
                    assert (error["code"], error["param"]) == ("reply_not_found", "response_id")
            # Still there, for its own dialect's resume.
            async with http.get(f"{url}/v1/replies/{reply_id}/stream") as resumed:
                assert resumed.status == 200
                await resumed.read()


async def test_a_stored_response_not_streamed_can_be_read_again_and_continued():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        first = await client.responses.create(model="simulated", input="first question")
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        second = await client.responses.create(
            model="simulated",
            input="second question",
            instructions="be brief",
            previous_response_id=first.id,
        )
    # The second prompt held the first exchange: its input tokens say so.
    history = f"system: be brief\nuser: first question\nassistant: {first.output_text}"
    assert second.usage is not None
    expected = engine.count_tokens(history + "\nuser: second question")
    assert second.usage.input_tokens == expected
    assert second.previous_response_id == first.id


async def test_a_response_is_only_its_owners():
    engine = fast_engine(reply_text=REPLY)
    app = create_app(engine, ServerConfig(api_keys=("key-a", "key-b")))
    async with running(app) as url:
        a = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="key-a", max_retries=0)
        b = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="key-b", max_retries=0)
        async with a, b:
            mine = await a.responses.create(model="simulated", input="x")
            for attempt in (
                b.responses.retrieve(mine.id),
                b.responses.cancel(mine.id),
                b.responses.delete(mine.id),
            ):
                with pytest.raises(openai.NotFoundError):
                    await attempt
            # Continued by another key, it is not found either (said as OpenAI says it).
            with pytest.raises(openai.BadRequestError) as refused:
                await b.responses.create(model="simulated", input="y", previous_response_id=mine.id)
            assert refused.value.code == "previous_response_not_found"
            assert (await a.responses.retrieve(mine.id)).status == "completed"


async def test_a_client_leaving_a_stored_response_that_is_not_background_stops_it():
    engine = fast_engine(reply_text=REPLY * 50, delay_ms=20.0)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json={"input": "x", "stream": True}) as r:
            await r.content.readline()
        await wait_for(lambda: engine.stats().cancelled == 1)


async def test_on_a_server_resumable_by_default_a_response_whose_client_left_goes_on():
    # As a reply on another route does there: detached for the grace, and resumed whole.
    engine = fast_engine(reply_text=REPLY, delay_ms=20.0, jitter_ms=0.0)
    app = create_app(engine, ServerConfig(resumable_by_default=True))
    async with running(app) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json={"input": "x", "stream": True}) as r:
            created = json.loads((await r.content.readuntil(b"\n\n")).split(b"data: ")[1])
        response_id = created["response"]["id"]
        query = {"stream": "true"}
        async with http.get(f"{url}/v1/responses/{response_id}", params=query) as resumed:
            events = EventParser().feed(await resumed.read())
    assert engine.stats().cancelled == 0
    assert events[-1].type == "response.completed"
    text = "".join(json.loads(e.data)["delta"] for e in events if e.type.endswith("text.delta"))
    assert text.strip() == REPLY


async def test_starting_after_out_of_range_or_not_a_number_is_a_400():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        done = await client.responses.create(model="simulated", input="x")
        async with aiohttp.ClientSession() as http:
            for value in ("-1", "x", "1.5", "99999"):
                query = {"stream": "true", "starting_after": value}
                async with http.get(f"{url}/v1/responses/{done.id}", params=query) as response:
                    assert response.status == 400, value
                    assert (await response.json())["error"]["param"] == "starting_after"


async def test_a_bad_stream_flag_names_every_spelling_that_is_accepted():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        done = await client.responses.create(model="simulated", input="x")
        path = f"{url}/v1/responses/{done.id}"
        async with aiohttp.ClientSession() as http:
            async with http.get(path, params={"stream": "maybe"}) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            named = set(re.findall(r"\b\w+\b", error["message"].split(";")[0]))
            for word in ("1", "true", "yes", "0", "false", "no", "True", "NO"):
                async with http.get(path, params={"stream": word}) as response:
                    assert response.status == 200, word
                    streamed = response.content_type == "text/event-stream"
                    await response.read()
                assert streamed == (word.lower() in ("1", "true", "yes")), word
                assert word.lower() in named, (word, error["message"])
    assert error["param"] == "stream" and "'maybe'" in error["message"]


async def test_a_resume_at_the_last_event_of_a_response_names_the_response_id():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        stream = await client.responses.create(model="simulated", input="x", stream=True)
        last = -1
        async for event in stream:
            last = event.sequence_number
            if event.type == "response.completed":
                done = event.response
        async with aiohttp.ClientSession() as http:
            query = {"stream": "true", "starting_after": str(last)}
            async with http.get(f"{url}/v1/responses/{done.id}", params=query) as response:
                assert response.status == 409
                error = (await response.json())["error"]
            query = {"stream": "true", "starting_after": str(last + 1)}
            async with http.get(f"{url}/v1/responses/{done.id}", params=query) as response:
                assert response.status == 400
                past = (await response.json())["error"]
    assert error["code"] == "reply_ended" and error["param"] == "starting_after"
    assert error["message"].startswith(f"response {done.id} has ended and {last} is its last")
    # Quoted in sequence numbers, the client's, not the log's ids.
    assert past["message"] == f"starting_after {last + 1} is past this reply's last event ({last})"


async def test_the_sdk_asks_once_to_resume_after_the_last_event_of_an_ended_response():
    # The SDKs retry a 409 unless told not to: "reply_ended" is final, so it says so, and a
    # client with the default retries has its answer from one request, with no back-off.
    sent: list[str] = []

    async def count(request: Any) -> None:
        sent.append(str(request.url.path))

    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url:
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [count]})
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=2, http_client=http
        )
        async with client:
            done = await client.responses.create(model="simulated", input="x", max_output_tokens=3)
            last = len([e async for e in await client.responses.retrieve(done.id, stream=True)])
            sent.clear()
            with pytest.raises(openai.ConflictError) as raised:
                await client.responses.retrieve(done.id, stream=True, starting_after=last - 1)
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert sent == [f"/v1/responses/{done.id}"]


async def test_retrieve_takes_include_and_include_obfuscation_only_at_what_it_does():
    # The SDK sends both from OpenAI's spec of the route; a value this server cannot honour
    # is refused, as POST /v1/responses refuses it, rather than ignored.
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        done = await client.responses.create(model="simulated", input="x", max_output_tokens=3)
        refused: list[Any] = []
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as padded:
                await client.responses.retrieve(done.id, stream=stream, include_obfuscation=True)
            with pytest.raises(openai.BadRequestError) as included:
                await client.responses.retrieve(
                    done.id, stream=stream, include=["reasoning.encrypted_content"]
                )
            refused += [padded.value.body, included.value.body]
        plain = await client.responses.retrieve(
            done.id, include_obfuscation=False, include=[LOGPROBS]
        )
        events = await client.responses.retrieve(done.id, stream=True, include_obfuscation=False)
        assert isinstance(events, openai.AsyncStream)
        streamed = [event.type async for event in events]
        # What to include applies to the object: a stream replays its events as made.
        with pytest.raises(openai.BadRequestError) as with_stream:
            await client.responses.retrieve(done.id, stream=True, include=[LOGPROBS])
    assert [(body["param"], body["code"]) for body in refused] == [
        ("include_obfuscation", "unsupported_parameter"),
        ("include[0]", "unsupported_parameter"),
    ] * 2
    assert plain.status == "incomplete" and streamed[-1] == "response.incomplete"
    body: Any = with_stream.value.body
    assert (body["param"], body["code"]) == ("include", "unsupported_parameter")


async def test_a_deleted_response_is_named_a_response_when_it_is_not_found():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        done = await client.responses.create(model="simulated", input="x", max_output_tokens=3)
        await client.responses.delete(done.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(done.id)
    assert gone.value.body["param"] == "response_id"  # type: ignore[index]
    assert gone.value.body["message"] == NO_SUCH_RESPONSE  # type: ignore[index]


async def test_a_cursor_without_stream_is_refused_not_ignored():
    # The object has no events to start after: a cursor sent without stream=true would
    # otherwise be dropped without a word.
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        done = await client.responses.create(model="simulated", input="x", max_output_tokens=3)
        with pytest.raises(openai.BadRequestError) as after:
            await client.responses.retrieve(done.id, starting_after=2)
        async with aiohttp.ClientSession() as http:
            path = f"{url}/v1/responses/{done.id}"
            async with http.get(path, params={"last_event_id": "3"}) as response:
                by_id = (response.status, (await response.json())["error"]["param"])
        whole = await client.responses.retrieve(done.id)
    assert after.value.body["param"] == "starting_after"  # type: ignore[index]
    assert "send stream=true" in after.value.message
    assert by_id == (400, "last_event_id")
    assert whole.id == done.id


async def test_an_event_source_resumes_a_response_with_last_event_id():
    engine = fast_engine(reply_text=REPLY)
    async with running(create_app(engine)) as url, sdk(url) as client:
        done = await client.responses.create(model="simulated", input="x", background=True)
        await wait_for(lambda: engine.stats().finished == 1)
        async with aiohttp.ClientSession() as http:
            headers = {"Last-Event-ID": "5", "Accept": "text/event-stream"}
            query = {"stream": "true"}
            path = f"{url}/v1/responses/{done.id}"
            async with http.get(path, params=query, headers=headers) as response:
                events = EventParser().feed(await response.read())
    # The header is an id (the log's number): the next event's id is 6, its sequence number 5.
    assert [int(event.id or "0") for event in events] == list(range(6, 6 + len(events)))
    numbers = [json.loads(event.data)["sequence_number"] for event in events]
    assert numbers == list(range(5, 5 + len(numbers)))
    assert events[-1].type == "response.completed"


async def test_replystream_extensions_with_a_stop_list_are_a_reply_not_a_500():
    # The extensions are validated once, then put together: a stop list was checked again,
    # as a tuple, and failed.
    engine = fast_engine(reply_text=REPLY)
    body = {"input": "x", "replystream": {"stop": ["four"], "seed": 3, "batch_tokens": 2}}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=body) as response:
            assert response.status == 200, await response.text()
            whole = await response.json()
    assert whole["status"] == "completed"


async def test_the_whole_response_and_every_event_validate_as_the_sdks_own_types():
    # The SDK builds its objects without validating them, so a field its types require and
    # the server leaves out (the usage's ``cache_write_tokens``) is an AttributeError only
    # when read: validate the raw JSON against the SDK's types instead.
    engine = fast_engine(reply_text=REPLY)
    body = {"input": "count", "max_output_tokens": 3}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=body) as response:
            whole = await response.json()
        async with http.post(f"{url}/v1/responses", json={**body, "stream": True}) as response:
            events = EventParser().feed(await response.read())
    Response.model_validate(whole)
    adapter: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(json.loads(event.data))
    assert whole["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


async def test_an_unknown_previous_response_is_openais_previous_response_not_found():
    # The code coding agents read to send the whole conversation again (it was a 404
    # reply_not_found); so is a response deleted before it is continued.
    async with running(create_app(fast_engine())) as url, sdk(url) as client:
        gone = await client.responses.create(model="simulated", input="x")
        await client.responses.delete(gone.id)
        for previous in ("resp_abc", gone.id):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(
                    model="simulated", input="y", previous_response_id=previous
                )
            assert refused.value.code == "previous_response_not_found"
            assert refused.value.param == "previous_response_id"


async def test_the_object_repeats_what_openais_does_of_its_request_and_when_it_completed():
    """Keys OpenAI's response object always has were missing (a typed client finds them
    absent): the request's user, safety_identifier, prompt_cache_key and max_tool_calls
    (refused before), the tier that served it, completed_at, and each function tool's
    parameters and strict (null when not given)."""
    engine = fast_engine(reply_text=REPLY)
    tool = {"type": "function", "name": "get_weather"}
    body = {
        "input": "count",
        "user": "u-1",
        "safety_identifier": "s-1",
        "prompt_cache_key": "k-1",
        "max_tool_calls": 3,  # of OpenAI's built-in tools, which this server has none of
        "tools": [tool],
        "stream": True,
    }
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/responses", json=body) as response:
            events = EventParser().feed(await response.read())
    opened = json.loads(events[0].data)["response"]
    done = json.loads(events[-1].data)["response"]
    for shown in (opened, done):
        assert (shown["user"], shown["safety_identifier"]) == ("u-1", "s-1")
        assert (shown["prompt_cache_key"], shown["service_tier"]) == ("k-1", "default")
        assert shown["max_tool_calls"] == 3
        assert shown["tools"] == [{**tool, "parameters": None, "strict": None}]
    assert opened["completed_at"] is None and done["status"] == "completed"
    assert done["completed_at"] >= done["created_at"]
    Response.model_validate(done)


class _DeletedOnceFound(MemoryReplayStore):
    """A store whose response named in ``doomed`` is deleted right after it is first read:
    a DELETE landing between a continuation finding its previous response and reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.doomed: set[str] = set()

    async def read(self, reply_id: str, after: int, wait_s: float) -> ReadResult | None:
        result = await super().read(reply_id, after, wait_s)
        if reply_id in self.doomed:
            self.doomed.discard(reply_id)
            await self.delete(reply_id)
        return result


async def test_a_previous_response_deleted_while_it_is_read_is_previous_response_not_found():
    # It was a 404 reply_not_found naming response_id, a field the request does not have.
    store = _DeletedOnceFound()
    async with running(create_app(fast_engine(), store=store)) as url, sdk(url) as client:
        gone = await client.responses.create(model="simulated", input="x")
        store.doomed.add(gone.id.removeprefix("resp_"))
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="simulated", input="y", previous_response_id=gone.id
            )
        assert refused.value.code == "previous_response_not_found"
        assert refused.value.param == "previous_response_id"


async def test_a_response_deleted_as_its_stream_is_asked_for_is_404_not_a_native_error():
    # Its dialect is told from its log's first event: read once the log was gone, the stream
    # began in the native dialect and ended with a native ``error`` event (no sequence number,
    # no response.failed), which no Responses client reads as its own.
    store = _DeletedOnceFound()
    async with running(create_app(fast_engine(), store=store)) as url:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/responses", json={"input": "x"}) as response:
                made = await response.json()
            store.doomed.add(made["id"].removeprefix("resp_"))
            async with http.get(f"{url}/v1/responses/{made['id']}?stream=true") as response:
                assert response.status == 404, await response.text()
                error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("reply_not_found", "response_id")
    assert error["message"] == NO_SUCH_RESPONSE
