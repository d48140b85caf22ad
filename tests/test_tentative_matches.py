"""A check's match that reaches the end of the text so far waits for the text after it, over a
real server on loopback: a ``\\b`` after "ass" read before "istant" comes stops nothing, and a
word that does end the text (the reply's end, a tool call) is stopped there, streamed or whole.
"""

from __future__ import annotations

import json
import re
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from replystream.delivery.moderation import MAX_TENTATIVE_CHARS, Check, Finding, RegexCheck
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.reply_script import parse_reply_script
from replystream.engine.simulated import SimulatedConfig, simulated_engine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.rawhttp import raw_request
from tests.sse_client import Received, post_events

# A model's tokens split words where its vocabulary does: "assistant" is "ass", "istant".
ASSISTANT = ["I am your ", "ass", "istant", ", happy ", "to help."]
ENDS_WITH_THE_WORD = ["I am your ", "ass"]
USER = [{"role": "user", "content": "Hi"}]
ROUTES = ["/v1/replies", "/v1/chat/completions"]


def serve(steps: list[dict[str, Any]], holdback: int = 3) -> AbstractAsyncContextManager[str]:
    """``serve --engine simulated --reply-script S --ban-regex 'word=\\bass\\b'``."""
    script = parse_reply_script(steps)
    engine = simulated_engine(SimulatedConfig(delay_ms=1, jitter_ms=0, script=script))
    check = RegexCheck({"word": r"\bass\b"}, name="regex")
    policy = DeliveryPolicy(holdback_tokens=holdback, checks=(check,))
    return running(create_app(engine, ServerConfig(policy=policy)))


def ask(route: str, stream: bool, **more: Any) -> dict[str, Any]:
    if route == "/v1/replies":
        return {"prompt": "Hi", "stream": stream, **more}
    return {"model": "simulated", "messages": USER, "stream": stream, **more}


async def whole(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await raw_request(url, "POST", json.dumps(body).encode())
    assert response.status == 200
    answer: dict[str, Any] = json.loads(await response.read_body())
    return answer


def chat_finishes(got: Received) -> list[str]:
    return [
        choice["finish_reason"]
        for event in got.events
        if event.type == "message" and event.data != "[DONE]"
        for choice in json.loads(event.data)["choices"]
        if choice["finish_reason"] is not None
    ]


def shows_the_word(raw: bytes) -> bool:
    """Whether the word's token left in any event (the chat role "assistant" is no token)."""
    return b'"ass"' in raw or b"your ass" in raw


def moderated_count(metrics: bytes, route: str) -> float:
    found = re.search(
        rb'replystream_replies_total\{endpoint="%s",outcome="moderated"\} ([0-9.e+]+)'
        % route.encode(),
        metrics,
    )
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("holdback", [0, 3])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_word_boundary_read_before_the_rest_of_the_word_stops_nothing(
    route: str, holdback: int
):
    steps = [{"text": text} for text in ASSISTANT]
    async with serve(steps, holdback) as url:
        streamed = await post_events(f"{url}{route}", ask(route, True))
        body = await whole(f"{url}{route}", ask(route, False))
    said = "".join(ASSISTANT)
    assert re.search(r"\bass\b", said) is None
    if route == "/v1/replies":
        assert streamed.text == said and streamed.types[-1] == "done"
        assert "moderated" not in streamed.types
        assert body["text"] == said and body["finish_reason"] == "stop"
    else:
        assert streamed.chat_text == said and chat_finishes(streamed) == ["stop"]
        assert body["choices"][0]["message"]["content"] == said
        assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("holdback", [0, 3])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_word_that_ends_the_reply_is_stopped_at_the_end_and_never_sent(
    route: str, holdback: int
):
    steps = [{"text": text} for text in ENDS_WITH_THE_WORD]
    async with serve(steps, holdback) as url:
        streamed = await post_events(f"{url}{route}", ask(route, True))
        body = await whole(f"{url}{route}", ask(route, False))
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    assert not shows_the_word(streamed.raw)
    assert moderated_count(metrics, route) == 2  # streamed and whole
    if route == "/v1/replies":
        assert streamed.text == "I am your " and streamed.types[-1] == "moderated"
        assert "done" not in streamed.types
        moderated = streamed.of_type("moderated")[0]
        assert (moderated["check"], moderated["released_chars"]) == ("regex", 10)
        assert body["text"] == "I am your " and body["finish_reason"] == "moderated"
    else:
        assert streamed.chat_text == "I am your "
        assert chat_finishes(streamed) == ["content_filter"]
        assert streamed.events[-1].data == "[DONE]"
        assert body["choices"][0]["message"]["content"] == "I am your "
        assert body["choices"][0]["finish_reason"] == "content_filter"
        assert body["replystream_moderation"]["check"] == "regex"


@pytest.mark.parametrize("route", ROUTES)
async def test_a_word_that_ends_the_text_before_a_tool_call_is_stopped_at_the_call(route: str):
    steps: list[dict[str, Any]] = [
        *({"text": text} for text in ENDS_WITH_THE_WORD),
        {"tool_call": {"name": "get_weather", "id": "call_W", "arguments": "{}"}},
        {"text": "istant"},
    ]
    async with serve(steps) as url:
        streamed = await post_events(f"{url}{route}", ask(route, True))
        body = await whole(f"{url}{route}", ask(route, False))
    assert not shows_the_word(streamed.raw) and b"get_weather" not in streamed.raw
    if route == "/v1/replies":
        assert streamed.text == "I am your " and streamed.types[-1] == "moderated"
        assert body["text"] == "I am your " and body["finish_reason"] == "moderated"
        assert not body.get("tool_calls")
    else:
        assert streamed.chat_text == "I am your "
        assert chat_finishes(streamed) == ["content_filter"]
        message = body["choices"][0]["message"]
        assert message["content"] == "I am your " and not message.get("tool_calls")
        assert body["choices"][0]["finish_reason"] == "content_filter"


async def test_each_choice_of_several_is_decided_at_its_own_end():
    steps = [{"text": text} for text in ENDS_WITH_THE_WORD]
    route = "/v1/chat/completions"
    async with serve(steps) as url:
        streamed = await post_events(f"{url}{route}", ask(route, True, n=2))
        body = await whole(f"{url}{route}", ask(route, False, n=2))
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    # A check stopped every choice: the reply was moderated, streamed and whole.
    assert moderated_count(metrics, route) == 2
    assert not shows_the_word(streamed.raw)
    assert chat_finishes(streamed) == ["content_filter", "content_filter"]
    assert streamed.chat_text == "I am your " * 2
    assert streamed.events[-1].data == "[DONE]"
    for choice in body["choices"]:
        assert choice["message"]["content"] == "I am your "
        assert choice["finish_reason"] == "content_filter"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_a_word_a_token_begins_inside_is_not_shown_in_its_log_probability(route: str):
    # " ass" might yet be " assistant": the space before the word goes out, the token does
    # not, so its log probability (which names it) is not sent when ", sir" decides it.
    steps = [{"text": text} for text in ["I am your", " ass", ", sir"]]
    if route == "/v1/completions":
        body = {"model": "simulated", "prompt": "Hi", "logprobs": 1}
    else:
        body = {"model": "simulated", "messages": USER, "logprobs": True, "top_logprobs": 1}
    async with serve(steps, holdback=0) as url:
        streamed = await post_events(f"{url}{route}", {**body, "stream": True})
        answer = await whole(f"{url}{route}", body)
    assert b"ass" not in streamed.raw.replace(b"assistant", b"")
    chunks = [
        json.loads(event.data)
        for event in streamed.events
        if event.type == "message" and event.data != "[DONE]"
    ]
    released = [c["replystream_moderation"] for c in chunks if "replystream_moderation" in c]
    moderation = answer.get("replystream_moderation") or answer["choices"][0].get(
        "replystream_moderation"
    )
    assert released == [moderation]
    assert moderation["released_chars"] == len("I am your ")
    assert moderation["released_tokens"] == 1


class CountedCheck:
    """A check that counts the characters it is given to read, from where it may begin."""

    def __init__(self, check: Check) -> None:
        self.name = check.name
        self.context_chars = check.context_chars
        self.revision = check.revision
        self._check = check
        self.read = 0

    def find(self, text: str, start: int = 0) -> Finding | None:
        self.read += len(text) - start
        return self._check.find(text, start)


@pytest.mark.parametrize("pattern", [r"\bsk-[A-Za-z0-9_-]{20,}", r"[A-Za-z0-9]{32,}"])
async def test_a_match_that_keeps_growing_is_final_at_its_length_limit(pattern: str):
    # A key written on and on stays a possible match that the next text might undo: read
    # again from its start with every token, a run of thousands of letters cost a reply its
    # square (a pattern matching at every later place of the run, its cube: seconds of the
    # event loop for a few thousand tokens). Past its limit it is final: the reply is
    # stopped there, and each token's reading stays within the limit.
    pieces = ["Here is ", "sk-", *["abcd"] * 2_000, " done."]
    script = parse_reply_script([{"text": text} for text in pieces])
    engine = simulated_engine(SimulatedConfig(delay_ms=0, jitter_ms=0, script=script))
    check = CountedCheck(RegexCheck({"key": pattern}, name="regex"))
    policy = DeliveryPolicy(holdback_tokens=0, checks=(check,))
    route = "/v1/chat/completions"
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        body = await whole(f"{url}{route}", ask(route, False))
    assert body["choices"][0]["finish_reason"] == "content_filter"
    assert "abcd" * 10 not in body["choices"][0]["message"]["content"]
    # Stopped within the limit's worth of tokens, the engine with it.
    assert body["usage"]["completion_tokens"] <= 2 + MAX_TENTATIVE_CHARS // 4 + 2
    tokens = body["usage"]["completion_tokens"]
    assert check.read <= tokens * (MAX_TENTATIVE_CHARS + check.context_chars + 16)
