"""A reply asked for at least ``min_tokens`` tokens, continued at another upstream mid-reply:
the relay is a real ``replystream serve --engine upstream:...`` process in front of two aiohttp
upstreams on loopback sockets. The continuation asks for what is left of both limits, so an
upstream that checks ``min_tokens`` against ``max_tokens`` (vLLM, SGLang, replystream itself)
takes it, and the client reads the whole reply."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from replystream.server import running
from tests.processes import replica
from tests.sse_client import post_events
from tests.test_upstream_routing import chunk
from tests.test_upstream_stop_across_seam import CrashesThenContinues

pytestmark = pytest.mark.slow


class ChecksLimits(CrashesThenContinues):
    """Four words before the crash; asked to continue, a 400 when ``min_tokens`` is above
    ``max_tokens``, as vLLM answers, else two words and a finish."""

    def __init__(self) -> None:
        words = b"".join(chunk(w) for w in ("a ", "b ", "c ", "d "))
        super().__init__(words, chunk("e ") + chunk("f") + chunk(None, "length"))

    def answer_instead(self, body: dict[str, Any]) -> web.Response | None:
        if body.get("min_tokens", 0) > body.get("max_tokens", 1 << 30):
            message = "min_tokens must be less than or equal to max_tokens"
            return web.json_response({"error": {"message": message}}, status=400)
        return None


async def test_a_continuation_asks_for_what_is_left_of_min_tokens():
    upstreams = [ChecksLimits(), ChecksLimits()]
    async with running(upstreams[0].app()) as one, running(upstreams[1].app()) as two:
        relay_args = (f"--engine=upstream:{one}/v1", f"--engine=upstream:{two}/v1")
        async with replica(*relay_args, "--upstream-continue") as (_, relay):
            ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            chat = await post_events(
                f"{relay}/v1/chat/completions", {**ask, "max_tokens": 6, "min_tokens": 5}
            )
    [continued] = [b for u in upstreams for b in u.bodies if b.get("continue_final_message")]
    assert (continued["max_tokens"], continued["min_tokens"]) == (2, 1)
    assert chat.chat_text == "a b c d e f"
