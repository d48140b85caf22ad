"""Numbers JSON has not, in fields that take any JSON and pass it on.

The JSON parser reads ``1e999`` as infinity and takes ``NaN`` (no JSON at all). A field that
takes any value and is passed on (an Anthropic ``tool_use`` block's ``input``, relayed as the
call's arguments; a Responses part's ``annotations`` and ``logprobs``, kept with a stored
response and listed back) would write them on as ``Infinity`` and ``NaN``, JSON that strict
parsers refuse: each is a 400 naming the field and where in it the number is. Raw bodies to a
real server on a loopback socket.
"""

from __future__ import annotations

import aiohttp
import pytest

from replystream.server import create_app, running
from tests.conftest import fast_engine

ANTHROPIC = (
    "/v1/messages",
    '{"model": "simulated", "max_tokens": 5, "messages": ['
    '{"role": "user", "content": "hi"},'
    '{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",'
    ' "input": {"x": [1, NUMBER]}}]},'
    '{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}'
    "]}",
    "messages[1].content[0].input",
    "x/1",
)
RESPONSES = (
    "/v1/responses",
    '{"model": "simulated", "input": [{"role": "user", "content": "hi"},'
    '{"role": "assistant", "content": [{"type": "output_text", "text": "yo",'
    ' "annotations": [{"score": NUMBER}]}]},'
    '{"role": "user", "content": "more"}]}',
    "input[1].content[0].annotations",
    "0/score",
)


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN"])
@pytest.mark.parametrize(
    ("path", "body", "param", "where"), [ANTHROPIC, RESPONSES], ids=["messages", "responses"]
)
async def test_a_number_json_has_not_is_a_400_naming_where(
    number: str, path: str, body: str, param: str, where: str
):
    headers = {"Content-Type": "application/json", "anthropic-version": "2023-06-01"}
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        raw = body.replace("NUMBER", number)
        async with http.post(f"{url}{path}", data=raw, headers=headers) as got:
            status, text = got.status, await got.text()
        fine = body.replace("NUMBER", "1.5")
        async with http.post(f"{url}{path}", data=fine, headers=headers) as taken:
            assert taken.status == 200, await taken.text()
    assert status == 400, text
    assert param in text and where in text and "infinity or NaN" in text
