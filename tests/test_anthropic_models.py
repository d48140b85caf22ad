"""``GET /v1/models`` and ``GET /v1/models/{model}`` through the anthropic SDK (which sends
``anthropic-version``): Anthropic's shapes and paging; the openai SDK still gets OpenAI's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Literal

import anthropic
import openai
import pytest
from aiohttp import web

from tests.chat_upstream import RecordingUpstream, relaying_to

NAMES = ["alpha", "beta", "gamma"]
Stage = Literal["active", "deprecated", "retired"]  # a model's lifecycle stage


class ThreeModels(RecordingUpstream):
    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": n} for n in NAMES]})


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with relaying_to(ThreeModels()) as served:
        yield served


def sdk(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_the_model_list_is_anthropics_page_and_pages_as_the_sdk_asks(url: str):
    async with sdk(url) as client:
        page = await client.models.list()
        one = await client.models.retrieve("beta")
        paged = [model.id async for model in client.models.list(limit=1)]
        before = await client.models.list(before_id="gamma", limit=1)
    assert [model.id for model in page.data] == NAMES == paged
    assert (page.has_more, page.first_id, page.last_id) == (False, "alpha", "gamma")
    for model in (*page.data, one):
        assert model.type == "model" and model.display_name == model.id
        assert isinstance(model.created_at, datetime) and model.created_at.tzinfo is not None
    assert one.id == "beta"
    assert ([m.id for m in before.data], before.has_more) == (["beta"], True)
    async with oai(url) as other:  # no anthropic-version: OpenAI's list, as before
        listed = await other.models.list()
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [
        (n, "model", "replystream") for n in NAMES
    ]


async def test_errors_on_the_model_routes_are_anthropics_for_its_clients(url: str):
    async with sdk(url) as client:
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.models.retrieve("nope")
        with pytest.raises(anthropic.BadRequestError) as bad_limit:
            await client.models.list(limit=0)
        with pytest.raises(anthropic.BadRequestError) as bad_cursor:
            await client.models.list(after_id="nope")
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert bad_limit.value.body["error"]["param"] == "limit"  # type: ignore[index]
    assert bad_cursor.value.body["error"]["param"] == "after_id"  # type: ignore[index]
    async with oai(url) as other:
        with pytest.raises(openai.NotFoundError) as openais:
            await other.models.retrieve("nope")
    assert openais.value.code == "model_not_found"
    assert "type" not in openais.value.response.json()  # OpenAI's shape: the error alone


async def test_the_list_keeps_to_the_lifecycle_stages_asked_for(url: str):
    """``lifecycle`` (Anthropic's filter, ``lifecycle[]=...`` as the SDK sends it) was
    ignored: a client asking for retired or deprecated models got the active ones. Every
    model served here is active, so it is listed when ``active`` is asked or no stage is."""
    asked: list[tuple[Stage, ...]] = [
        ("active",),
        ("deprecated", "active"),
        ("retired",),
        ("deprecated",),
    ]
    async with sdk(url) as client:
        pages = {stages: await client.models.list(lifecycle=list(stages)) for stages in asked}
        past = await client.models.list(lifecycle=["retired"], after_id="alpha", limit=1)
        with pytest.raises(anthropic.BadRequestError) as unknown:
            await client.models.list(lifecycle=["beta"])  # type: ignore[list-item]
        with pytest.raises(anthropic.BadRequestError) as too_many:
            await client.models.list(lifecycle=["active", "deprecated", "retired", "active"])
    listed = {stages: [m.id for m in page.data] for stages, page in pages.items()}
    assert listed == {
        ("active",): NAMES,
        ("deprecated", "active"): NAMES,
        ("retired",): [],
        ("deprecated",): [],
    }
    empty = pages[("retired",)]
    assert (empty.has_more, empty.first_id, empty.last_id) == (False, None, None)
    assert (past.data, past.has_more) == ([], False)
    assert unknown.value.body["error"]["param"] == "lifecycle[0]"  # type: ignore[index]
    assert too_many.value.body["error"]["param"] == "lifecycle"  # type: ignore[index]
