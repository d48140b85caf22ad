"""The models a relay lists, from its upstream's ``GET /models``: an empty id is no model.
An upstream on a loopback port, replystream relaying it on another, and the official SDKs
as clients."""

from __future__ import annotations

import anthropic
import openai
from aiohttp import web

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running


async def _models(_: web.Request) -> web.Response:
    listed = [{"id": "a"}, {"id": ""}, {"id": "b"}]
    return web.json_response({"object": "list", "data": listed})


async def test_an_empty_model_id_is_not_listed_and_paging_goes_on():
    upstream_app = web.Application()
    upstream_app.router.add_get("/v1/models", _models)
    async with running(upstream_app) as upstream:
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/v1"),)))
        async with (
            running(create_app(engine)) as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oa,
            anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as an,
        ):
            assert [m.id for m in (await oa.models.list()).data] == ["a", "b"]
            assert [m.id async for m in an.models.list(limit=1)] == ["a", "b"]
