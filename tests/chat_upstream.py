"""A stand-in OpenAI-compatible upstream on aiohttp, for relay tests in this process: it lists
one model and answers ``POST /v1/chat/completions`` as its subclass's ``chat`` says."""

from __future__ import annotations

from aiohttp import web


class ChatUpstream:
    """Serves ``GET /v1/models`` (the model ``m``) and a subclass's ``chat``."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app
