"""``POST /v1/responses/input_tokens``: the input tokens a response of the same request would
report in its ``usage``, as OpenAI's API answers it (``{"object": "response.input_tokens",
"input_tokens": N}``).

The body is a response's prompt (``InputTokensBody``: the fields of OpenAI's spec for this
route), made into a request by the code that makes a response's (``server.responses_prompt``:
the ``previous_response_id`` history, the ``instructions``, tools, the prompt limit, all checked
the same way), and counted by the engine as its start would build the prompt
(``server.context.count_prompt``, which the Anthropic count shares). A count starts no reply:
nothing is admitted into the engine and no reply metric moves. This file must not know how
tokens are made or counted.
"""

from __future__ import annotations

from aiohttp import web

from replystream.server.context import count_prompt
from replystream.server.errors import HTTPAPIError
from replystream.server.front_door import expect_later
from replystream.server.refusal_names import refusals_naming
from replystream.server.responses_prompt import RESPONSES_FIELDS, response_prompt
from replystream.server.responses_schemas import InputTokensBody
from replystream.server.validation import read_model


async def handle_input_tokens(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses/input_tokens``: the ``usage.input_tokens`` the same request's
    response would report."""
    body = await read_model(request, InputTokensBody)
    if body.input is None and body.previous_response_id is None:  # nothing to count
        message = "input is required unless previous_response_id names a conversation to count"
        raise HTTPAPIError(400, message, code="missing_required_parameter", param="input")
    made = await response_prompt(request, body)
    with refusals_naming(RESPONSES_FIELDS):
        counted = count_prompt(request, made.generation)
    return web.json_response({"object": "response.input_tokens", "input_tokens": counted})


def add_input_tokens_route(app: web.Application) -> None:
    """Register ``POST /v1/responses/input_tokens`` on ``app``."""
    app.router.add_post(
        "/v1/responses/input_tokens", handle_input_tokens, expect_handler=expect_later
    )
