"""A model's refusal through the relay: an upstream that declines to answer a reply held to a
schema streams its words in ``delta.refusal`` instead of ``delta.content``, as OpenAI's own
API does. Each dialect says it as a refusal (chat's ``refusal``, a Responses ``refusal``
part, Anthropic's ``refusal`` stop reason), streamed and whole, stored and read back, never
as a reply that finished with no text; a refusal sent back as history is taken; and its
words are text to the moderation checks.

The upstream is a small aiohttp app in this process (a real server on a loopback port), the
relay a replystream app serving an ``UpstreamEngine``; the clients are the official SDKs and a
plain HTTP client.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
from pydantic import BaseModel

from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.server.server_config import ServerConfig
from tests.sse_client import Received, post_events
from tests.test_upstream_routing import Scripted, Upstream, relay

ASK: Any = [{"role": "user", "content": "How do I pick a lock?"}]
WORDS = ["I'm sorry, ", "I can't ", "help with that."]
REFUSAL = "".join(WORDS)


class Steps(BaseModel):
    steps: list[str]


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return b"data: " + json.dumps({**body, "choices": [choice]}).encode() + b"\n\n"


def chat_choices(got: Received) -> list[dict[str, Any]]:
    """Every choice of a streamed chat reply's chunks, in order."""
    chunks = [json.loads(e.data) for e in got.events if e.type == "message" and e.data != "[DONE]"]
    return [choice for chunk in chunks for choice in chunk["choices"]]


def refusing() -> Scripted:
    """An upstream that refuses as OpenAI's API streams a refusal: a role chunk with a null
    content and an empty refusal, the words in ``refusal`` pieces, a ``stop`` finish, usage."""
    usage = {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}
    return Scripted(
        [
            _chunk({"role": "assistant", "content": None, "refusal": ""}),
            *(_chunk({"refusal": word}) for word in WORDS),
            _chunk({}, "stop"),
            b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n",
        ]
    )


async def test_chat_says_an_upstreams_refusal_in_refusal_streamed_and_whole():
    up = refusing()
    async with (
        relay([up]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        whole = await oai.chat.completions.parse(model="m", messages=ASK, response_format=Steps)
        async with oai.chat.completions.stream(
            model="m", messages=ASK, response_format=Steps
        ) as stream:
            streamed = await stream.get_final_completion()
        raw = await post_events(
            f"{url}/v1/chat/completions",
            {"messages": ASK, "stream": True, "response_format": {"type": "json_object"}},
        )
    for got in (whole, streamed):
        choice = got.choices[0]
        assert choice.message.refusal == REFUSAL, choice
        assert not choice.message.content and choice.message.parsed is None
        assert choice.finish_reason == "stop"
    assert whole.choices[0].message.content is None  # as OpenAI's whole refusal has it
    deltas = [choice["delta"] for choice in chat_choices(raw)]
    assert "".join(d.get("refusal") or "" for d in deltas) == REFUSAL
    assert raw.chat_text == ""  # no word of it as content


async def test_responses_says_an_upstreams_refusal_in_a_refusal_part_and_keeps_it():
    up = refusing()
    async with (
        relay([up]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        parsed = await oai.responses.parse(model="m", input="Pick a lock", text_format=Steps)
        async with oai.responses.stream(model="m", input="Pick a lock", text_format=Steps) as s:
            events = [event async for event in s]
            final = await s.get_final_response()
        stored = await oai.responses.retrieve(final.id)
        whole = await oai.responses.create(model="m", input="Pick a lock", store=False)
        # The refusal sent back as history, as an agent's loop sends a response's output.
        history: Any = [{"role": "user", "content": "Pick a lock"}, *final.output]
        await oai.responses.create(model="m", input=[*history, {"role": "user", "content": "ok"}])
        await oai.responses.create(model="m", input="And now?", previous_response_id=final.id)
    for response in (parsed, final, stored, whole):
        assert response.status == "completed"
        [message] = response.output
        assert message.type == "message"
        [part] = message.content
        assert part.type == "refusal" and part.refusal == REFUSAL, response
    assert parsed.output_parsed is None and final.output_parsed is None
    kinds = [event.type for event in events]
    assert "response.output_text.delta" not in kinds
    assert "".join(e.delta for e in events if e.type == "response.refusal.delta") == REFUSAL
    [done] = [e for e in events if e.type == "response.refusal.done"]
    assert done.refusal == REFUSAL
    for sent in up.bodies[-2:]:  # both later turns gave the upstream the words said before
        assistant = [m for m in sent["messages"] if m["role"] == "assistant"]
        assert [m["content"] for m in assistant] == [REFUSAL]


async def test_anthropic_says_an_upstreams_refusal_with_its_refusal_stop_reason():
    up = refusing()
    ask: Any = [{"role": "user", "content": "How do I pick a lock?"}]
    fmt: Any = {"format": {"type": "json_schema", "schema": Steps.model_json_schema()}}
    async with (
        relay([up]) as url,
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as claude,
    ):
        whole = await claude.messages.create(
            model="m", max_tokens=50, messages=ask, output_config=fmt
        )
        async with claude.messages.stream(
            model="m", max_tokens=50, messages=ask, output_config=fmt
        ) as stream:
            streamed = await stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "refusal", message
        assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", REFUSAL)]


async def test_a_refusal_sent_back_in_a_chat_history_is_taken_and_relayed():
    up = refusing()
    async with (
        relay([up]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai,
    ):
        first = await oai.chat.completions.create(
            model="m", messages=ASK, response_format={"type": "json_object"}
        )
        said: Any = first.choices[0].message.model_dump(exclude_none=True)
        again = await oai.chat.completions.create(
            model="m", messages=[*ASK, said, {"role": "user", "content": "Why not?"}]
        )
    assert said == {"role": "assistant", "refusal": REFUSAL}
    assert again.choices[0].message.refusal == REFUSAL
    assert up.bodies[1]["messages"][1] == {"role": "assistant", "refusal": REFUSAL}


async def test_a_refusals_words_are_text_to_the_moderation_checks():
    checks = DeliveryPolicy(checks=(BannedPhrases(["help with"]),))
    async with relay([refusing()], server=ServerConfig(policy=checks)) as url:
        body = {"messages": ASK, "response_format": {"type": "json_object"}}
        streamed = await post_events(f"{url}/v1/chat/completions", {**body, "stream": True})
        whole = await post_events(f"{url}/v1/chat/completions", body)
    deltas = chat_choices(streamed)
    shown = "".join(choice["delta"].get("refusal") or "" for choice in deltas)
    assert shown == "I'm sorry, I can't "  # the phrase, in the last piece, never sent
    assert [c["finish_reason"] for c in deltas if c["finish_reason"]] == ["content_filter"]
    message = json.loads(whole.raw)["choices"][0]
    assert message["finish_reason"] == "content_filter"
    assert message["message"]["refusal"] == "I'm sorry, I can't "


async def test_a_refusal_after_text_relayed_leaves_that_text_an_answer():
    # A reply whose upstream stalled after "w0 w1 w2 " goes on at another upstream, which
    # refuses: its refusal marker came after text. Heeded, the whole reply called the
    # first upstream's answer a refusal, and a Responses stream sent events named
    # ``response.refusal.delta`` whose data said ``response.output_text.delta``, in a
    # message whose part was added as text and done as a refusal.
    answered = "w0 w1 w2 "
    streamed: dict[str, Received] = {}
    whole: dict[str, Any] = {}
    for route in ("chat", "whole", "responses"):
        upstreams = [Upstream(["m"], mode="stall"), refusing()]
        async with relay(upstreams, stall_s=0.4, continuation=True) as url:
            if route == "chat":
                body = {"messages": ASK, "stream": True}
                streamed[route] = await post_events(f"{url}/v1/chat/completions", body)
            elif route == "whole":
                got = await post_events(f"{url}/v1/chat/completions", {"messages": ASK})
                whole = json.loads(got.raw)["choices"][0]["message"]
            else:
                body = {"input": "How?", "stream": True}
                streamed[route] = await post_events(f"{url}/v1/responses", body)
    deltas = [choice["delta"] for choice in chat_choices(streamed["chat"])]
    assert "".join(d.get("content") or "" for d in deltas) == answered + REFUSAL
    assert not any("refusal" in d for d in deltas)
    assert whole["content"] == answered + REFUSAL and whole["refusal"] is None
    events = streamed["responses"].events
    for event in events:
        assert json.loads(event.data)["type"] == event.type
    texts = [json.loads(e.data)["delta"] for e in events if e.type == "response.output_text.delta"]
    assert "".join(texts) == answered + REFUSAL
    completed = json.loads(events[-1].data)["response"]
    assert completed["output"][0]["content"][0]["type"] == "output_text"
