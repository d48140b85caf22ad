"""``GET /v1/responses/{id}/input_items`` with the official openai SDK, and over raw HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.responses import (
    ResponseFunctionToolCallItem,
    ResponseFunctionToolCallOutputItem,
    ResponseInputMessageItem,
    ResponseItem,
    ResponseOutputMessage,
    ResponseReasoningItem,
)
from openai.types.responses.response_item_list import ResponseItemList
from pydantic import TypeAdapter

from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, MemoryReplayStore, ReplyInfo
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.redis_server import redis_server

REPLY = "one two three"
CALL = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"}
# Every kind of item an input may hold, every role, string and part content, given ids and
# a repeated one, and a status.
MIXED = [
    {"role": "system", "content": "be brief"},
    {"role": "developer", "content": [{"type": "input_text", "text": "use metric units"}]},
    {"type": "message", "role": "user", "content": "weather in Oslo?", "id": "msg_mine"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
    {**CALL, "id": "fc_given", "status": "completed"},
    {"type": "function_call_output", "call_id": "call_1", "output": "4 C"},
    {"type": "reasoning", "summary": [], "encrypted_content": "opaque", "id": "msg_mine"},
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "and "},
            {"type": "input_text", "text": "tomorrow?"},
        ],
    },
]
TOOLS = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]


def sdk(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def reply_of(response_id: str) -> str:
    return response_id.removeprefix("resp_")


async def listed(http: aiohttp.ClientSession, url: str, response_id: str, **query: Any) -> Any:
    async with http.get(f"{url}/v1/responses/{response_id}/input_items", params=query) as got:
        return got.status, await got.json()


async def test_a_string_input_is_one_user_message_with_an_id():
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        made = await client.responses.create(model="simulated", input="count", instructions="x")
        page = await client.responses.input_items.list(made.id)
        again = await client.responses.input_items.list(made.id)
    assert [type(item) for item in page.data] == [ResponseInputMessageItem]
    item = page.data[0]
    assert isinstance(item, ResponseInputMessageItem)
    assert item.id == f"msg_{reply_of(made.id)}_in_0"
    assert (item.role, item.status) == ("user", "completed")
    assert [part.model_dump(exclude_unset=True) for part in item.content] == [
        {"type": "input_text", "text": "count"}
    ]
    assert page.has_more is False
    assert again.data == page.data  # the same id on every call


async def test_every_kind_of_item_is_listed_in_its_output_item_shape():
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        made = await client.responses.create(model="simulated", input=MIXED, tools=TOOLS)  # type: ignore[arg-type]
        async with aiohttp.ClientSession() as http:
            status, raw = await listed(http, url, made.id, order="asc", limit="100")
            _, encrypted = await listed(
                http, url, made.id, order="asc", **{"include[]": "reasoning.encrypted_content"}
            )
        pages = [item async for item in client.responses.input_items.list(made.id, order="asc")]
    assert status == 200
    own = reply_of(made.id)
    assert raw == {
        "object": "list",
        "data": [
            {
                "id": f"msg_{own}_in_0",
                "type": "message",
                "role": "system",
                "content": [{"type": "input_text", "text": "be brief"}],
                "status": "completed",
            },
            {
                "id": f"msg_{own}_in_1",
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "use metric units"}],
                "status": "completed",
            },
            {
                "id": "msg_mine",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "weather in Oslo?"}],
                "status": "completed",
            },
            {
                "id": f"msg_{own}_in_3",
                "type": "message",
                "role": "assistant",
                "content": [
                    {
                        "type": "output_text",
                        "text": "let me look",
                        "annotations": [],
                        "logprobs": [],
                    }
                ],
                "status": "completed",
            },
            {"id": "fc_given", **CALL, "status": "completed"},
            {
                "id": f"fco_{own}_in_5",
                "type": "function_call_output",
                "call_id": "call_1",
                "output": "4 C",
                "status": "completed",
            },
            # Its id is an earlier item's: it gets its own, or ``after`` could not find it.
            {"id": f"rs_{own}_in_6", "type": "reasoning", "summary": [], "status": "completed"},
            {
                "id": f"msg_{own}_in_7",
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "and "},
                    {"type": "input_text", "text": "tomorrow?"},
                ],
                "status": "completed",
            },
        ],
        "first_id": f"msg_{own}_in_0",
        "last_id": f"msg_{own}_in_7",
        "has_more": False,
    }
    assert encrypted["data"][6]["encrypted_content"] == "opaque"
    assert [item for n, item in enumerate(encrypted["data"]) if n != 6] == [
        item for n, item in enumerate(raw["data"]) if n != 6
    ]
    # The SDK reads each as its own type, and its pages as the whole list.
    ResponseItemList.model_validate(raw)
    kinds: list[type] = [
        type(TypeAdapter(ResponseItem).validate_python(item)) for item in raw["data"]
    ]
    assert kinds == [
        ResponseInputMessageItem,
        ResponseInputMessageItem,
        ResponseInputMessageItem,
        ResponseOutputMessage,
        ResponseFunctionToolCallItem,
        ResponseFunctionToolCallOutputItem,
        ResponseReasoningItem,
        ResponseInputMessageItem,
    ]
    assert [item.model_dump(exclude_unset=True) for item in pages] == raw["data"]


async def test_pages_in_either_order_tell_every_item_once():
    messages = [{"role": "user", "content": f"message {n}"} for n in range(7)]
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        made = await client.responses.create(model="simulated", input=messages)  # type: ignore[arg-type]
        forwards = [
            i.id async for i in client.responses.input_items.list(made.id, order="asc", limit=2)
        ]
        backwards = [i.id async for i in client.responses.input_items.list(made.id, limit=3)]
        first = await client.responses.input_items.list(made.id, order="asc", limit=2)
        async with aiohttp.ClientSession() as http:
            # ``before`` pages back: the items just before it, in the order asked for.
            _, before = await listed(http, url, made.id, order="asc", limit="2", before=forwards[5])
            _, between = await listed(
                http, url, made.id, order="desc", after=forwards[5], before=forwards[1]
            )
            _, past_the_end = await listed(http, url, made.id, after=forwards[0])
    own = reply_of(made.id)
    assert forwards == [f"msg_{own}_in_{n}" for n in range(7)]
    assert backwards == forwards[::-1]  # desc, the default
    assert ([i.id for i in first.data], first.has_more) == (forwards[:2], True)
    assert [i["text"] for i in before["data"] for i in i["content"]] == ["message 3", "message 4"]
    assert before["has_more"] is True
    assert [item["id"] for item in between["data"]] == forwards[4:1:-1]
    assert between["has_more"] is False
    assert past_the_end == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


def _values(given: str | list[str]) -> list[str]:
    return [given] if isinstance(given, str) else given


@pytest.mark.parametrize(
    ("query", "param", "code"),
    [
        ({"limit": "0"}, "limit", "invalid_value"),
        ({"limit": "101"}, "limit", "invalid_value"),
        ({"limit": "ten"}, "limit", "invalid_value"),
        ({"limit": ["2", "3"]}, "limit", "invalid_value"),
        ({"order": "sideways"}, "order", "invalid_value"),
        ({"after": "msg_nobody"}, "after", "invalid_value"),
        ({"before": "msg_nobody"}, "before", "invalid_value"),
        ({"include[]": "file_search_call.results"}, "include[0]", "unsupported_parameter"),
        (
            {"include": ["reasoning.encrypted_content", "everything"]},
            "include[1]",
            "unsupported_parameter",
        ),
    ],
)
async def test_a_bad_query_value_is_a_400_naming_it(query, param, code):
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        made = await client.responses.create(model="simulated", input="x")
        async with aiohttp.ClientSession() as http:
            pairs = [(k, v) for k, given in query.items() for v in _values(given)]
            where = f"{url}/v1/responses/{made.id}/input_items"
            async with http.get(where, params=pairs) as refused:
                status, body = refused.status, await refused.json()
    assert status == 400, body
    assert (body["error"]["param"], body["error"]["code"]) == (param, code)
    assert body["error"]["type"] == "invalid_request_error"


async def test_a_models_text_sent_back_lists_its_logprobs_when_asked():
    logprob = {"token": "let", "logprob": -0.5, "bytes": [108, 101, 116], "top_logprobs": []}
    sent = {"type": "output_text", "text": "let", "annotations": [], "logprobs": [logprob]}
    given = [{"role": "assistant", "content": [sent]}, {"role": "user", "content": "go on"}]
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        made = await client.responses.create(model="simulated", input=given)  # type: ignore[arg-type]
        async with aiohttp.ClientSession() as http:
            _, plain = await listed(http, url, made.id, order="asc")
            _, asked = await listed(
                http, url, made.id, order="asc", **{"include[]": "message.output_text.logprobs"}
            )
    # Not asked for, a part still has logprobs, empty: OpenAI's specification requires the
    # field of an output_text part, and a response's own parts show [] so.
    assert plain["data"][0]["content"] == [{**sent, "logprobs": []}]
    assert asked["data"][0]["content"] == [sent]
    assert asked["data"][1] == plain["data"][1]  # a user's input_text has none
    ResponseItemList.model_validate(asked)


async def test_limit_takes_1_to_100():
    messages = [{"role": "user", "content": str(n)} for n in range(120)]
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        made = await client.responses.create(model="simulated", input=messages)  # type: ignore[arg-type]
        one = await client.responses.input_items.list(made.id, limit=1)
        most = await client.responses.input_items.list(made.id, limit=100)
        default = await client.responses.input_items.list(made.id)
        with pytest.raises(openai.BadRequestError):
            await client.responses.input_items.list(made.id, limit=101)
    assert (len(one.data), len(most.data), len(default.data)) == (1, 100, 20)
    assert one.has_more and most.has_more and default.has_more


async def test_a_continued_response_lists_only_its_own_input():
    async with running(create_app(fast_engine(reply_text=REPLY))) as url, sdk(url) as client:
        first = await client.responses.create(model="simulated", input="first question")
        second = await client.responses.create(
            model="simulated", input="second question", previous_response_id=first.id
        )
        items = await client.responses.input_items.list(second.id)
    texts = [part.text for item in items.data for part in item.content]  # type: ignore[union-attr]
    assert texts == ["second question"]


async def test_what_cannot_be_listed_is_a_404_as_for_retrieve():
    app = create_app(fast_engine(reply_text=REPLY), ServerConfig(api_keys=("key-a", "key-b")))
    async with running(app) as url, sdk(url, "key-a") as a, sdk(url, "key-b") as b:
        mine = await a.responses.create(model="simulated", input="x")
        not_stored = await a.responses.create(model="simulated", input="x", store=False)
        streamed = await a.responses.create(model="simulated", input="x", store=False, stream=True)
        streamed_id = [event async for event in streamed][-1].response.id  # type: ignore[union-attr]
        for client, response_id in (
            (b, mine.id),  # another key's
            (a, "resp_neverwas"),
            (a, "neverwas"),
            (a, not_stored.id),
            (a, streamed_id),
        ):
            with pytest.raises(openai.NotFoundError) as refused:
                await client.responses.input_items.list(response_id)
            error = refused.value.body
            assert isinstance(error, dict)
            assert (error["code"], error["param"]) == ("reply_not_found", "response_id")
        assert len((await a.responses.input_items.list(mine.id)).data) == 1


async def test_a_response_kept_without_its_input_items_is_a_410_not_a_500():
    store = MemoryReplayStore()
    # As a server before this route kept a stored response: its conversation as chat only.
    opened = {"type": "response.created", "response": {"id": "resp_old", "status": "completed"}}
    await store.create(ReplyInfo("old", context=json.dumps({"messages": []})))
    store.append("old", [LogEntry(1, "response.created", json.dumps(opened))])
    store.end("old", "done")
    async with running(create_app(fast_engine(), store=store)) as url, sdk(url) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.input_items.list("resp_old")
    assert refused.value.status_code == 410
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["code"] == "input_items_not_kept"


async def test_input_items_are_paged_alike_on_every_replica(tmp_path: Path):
    """The ids are made from what the store keeps: pages asked of either replica, in turn,
    tell every item once."""
    messages = [{"role": "user", "content": f"message {n}"} for n in range(5)]
    with redis_server(tmp_path) as redis:
        stores = RedisReplayStore(redis.url), RedisReplayStore(redis.url)
        apps = [create_app(fast_engine(reply_text=REPLY), ServerConfig(), s) for s in stores]
        async with running(apps[0]) as a_url, running(apps[1]) as b_url:
            async with sdk(a_url) as a, sdk(b_url) as b:
                made = await a.responses.create(model="simulated", input=messages)  # type: ignore[arg-type]
                ids: list[str] = []
                pages, more = 0, True
                while more:
                    client = (a, b)[pages % 2]  # each page from the other replica
                    page = await client.responses.input_items.list(
                        made.id, order="asc", limit=2, after=ids[-1] if ids else openai.omit
                    )
                    ids += [item.id for item in page.data]
                    pages, more = pages + 1, bool(page.has_more)
    assert ids == [f"msg_{reply_of(made.id)}_in_{n}" for n in range(5)]
    assert pages == 3
