"""A reasoning model's thinking through the relay: shown in the dialects that have a place
for it, in order and counted; kept out of the others and away from moderation checks, where it
still counts as the upstream's progress; and, once shown, the reply's commit point.

The upstream (``tests.thinking_upstream``) streams as vLLM's reasoning parsers and DeepSeek's
API do. Clients are the official SDKs.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from replystream.client.measure import measure_reply
from replystream.delivery.formats import Usage
from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogEntry
from replystream.delivery.responses_format import ResponsesStreamFormat
from replystream.delivery.responses_log import response_from_log
from replystream.delivery.responses_objects import ResponseSettings
from replystream.server.server_config import ServerConfig
from tests.sse_client import post_events
from tests.test_websocket import read_until_ended
from tests.thinking_upstream import ANSWER, COUNTED_THOUGHT_TOKENS, THINK_S, THOUGHTS, relay

ASK: Any = [{"role": "user", "content": "What is 2 + 2?"}]


async def test_chat_streams_the_thinking_as_reasoning_content_before_the_answer():
    for mode in ("deepseek", "vllm", "both"):
        async with (
            relay(mode) as (url, _),
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
        ):
            stream = await client.chat.completions.create(
                model="m", messages=ASK, stream=True, stream_options={"include_usage": True}
            )
            pieces: list[tuple[str, str]] = []
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    extra = choice.delta.model_extra or {}
                    if extra.get("reasoning_content"):
                        pieces.append(("thought", extra["reasoning_content"]))
                    if choice.delta.content:
                        pieces.append(("text", choice.delta.content))
        # Every thought once, in order, before the answer; none of it in the content.
        assert pieces == [("thought", t) for t in THOUGHTS] + [("text", a) for a in ANSWER], mode
        assert usage is not None and usage.completion_tokens == 5, mode
        assert usage.completion_tokens_details is not None
        assert usage.completion_tokens_details.reasoning_tokens == len(THOUGHTS), mode


async def test_a_whole_chat_completion_holds_the_thinking_beside_the_content():
    async with (
        relay("deepseek") as (url, _),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        completion = await client.chat.completions.create(model="m", messages=ASK)
    message = completion.choices[0].message
    assert message.content == "".join(ANSWER)
    assert (message.model_extra or {})["reasoning_content"] == "".join(THOUGHTS)
    assert completion.usage is not None and completion.usage.completion_tokens_details
    assert completion.usage.completion_tokens_details.reasoning_tokens == len(THOUGHTS)


async def test_native_replies_name_the_thinking_in_their_own_events():
    async with relay("vllm") as (url, _):
        got = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": True})
        whole = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": False})
    kinds = [t for t in got.types if t in ("thinking", "token")]
    assert kinds == ["thinking"] * len(THOUGHTS) + ["token"] * len(ANSWER)
    assert [e["text"] for e in got.of_type("thinking")] == THOUGHTS
    assert got.text == "".join(ANSWER)
    body = json.loads(whole.raw)
    assert body["thinking"] == "".join(THOUGHTS) and body["text"] == "".join(ANSWER)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHTS)}


async def test_where_the_thinking_is_not_shown_it_still_keeps_the_attempt_alive():
    # Under moderation checks (they read the answer alone) and in Anthropic's dialect (no
    # thinking blocks asked for), the thinking is not relayed; it is still the upstream's
    # progress, so the TTFT limit (less than the whole thinking) does not cut it.
    checks = ServerConfig(policy=DeliveryPolicy(checks=(BannedPhrases(["forbidden"]),)))
    async with relay("deepseek", checks, targets=2) as (url, upstream):
        got = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": True})
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client:
            message = await client.messages.create(model="m", max_tokens=50, messages=ASK)
    assert not got.of_type("thinking") and not got.of_type("error"), got.raw
    assert got.text == "".join(ANSWER)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "".join(ANSWER)  # type: ignore[union-attr]
    assert upstream.requests == 2  # one each: no attempt timed out and moved on


async def test_thinking_not_shown_is_counted_as_shown_thinking_is_without_upstream_usage():
    # An upstream that sends no usage: the relay counts the reply itself, the thinking's
    # pieces in it whether or not the dialect shows them, as an upstream's own usage does.
    async with relay("quiet") as (url, _):
        async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client:
            message = await client.messages.create(model="m", max_tokens=50, messages=ASK)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oc:
            chat = await oc.chat.completions.create(model="m", messages=ASK)
    assert message.content[0].text == "".join(ANSWER)  # type: ignore[union-attr]
    assert chat.usage is not None
    assert chat.usage.completion_tokens == len(THOUGHTS) + len(ANSWER)
    assert message.usage.output_tokens == len(THOUGHTS) + len(ANSWER)


async def test_the_upstreams_own_count_of_its_thinking_is_named_in_every_dialect():
    # Its usage says the thinking took more tokens than it came in pieces: every dialect
    # names the upstream's count, streamed and whole, as it gives its completion_tokens.
    want = COUNTED_THOUGHT_TOKENS
    async with (
        relay("counted") as (url, _),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        whole = await client.chat.completions.create(model="m", messages=ASK)
        stream = await client.chat.completions.create(
            model="m", messages=ASK, stream=True, stream_options={"include_usage": True}
        )
        streamed = None
        async for chunk in stream:
            streamed = chunk.usage or streamed
        response = await client.responses.create(model="m", input=ASK)
        native = await post_events(f"{url}/v1/replies", {"prompt": "2 + 2?", "stream": True})
    for usage in (whole.usage, streamed):
        assert usage is not None and usage.completion_tokens == want + len(ANSWER)
        assert usage.completion_tokens_details is not None
        assert usage.completion_tokens_details.reasoning_tokens == want
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == want
    (counted,) = native.of_type("usage")
    assert counted["completion_tokens_details"] == {"reasoning_tokens": want}


async def test_shown_thinking_commits_the_reply_to_its_upstream():
    # Thinking the client has read cannot be taken back: an upstream that breaks after it
    # ends the reply with an in-band error (continuation off), not an invisible failover.
    async with relay("cut", targets=2) as (url, upstream):
        got = await post_events(
            f"{url}/v1/chat/completions", {"model": "m", "messages": ASK, "stream": True}
        )
    assert got.status == 200
    thoughts = [
        c["delta"]["reasoning_content"]
        for e in got.events
        if e.type == "message" and e.data != "[DONE]"
        for c in json.loads(e.data)["choices"]
        if "reasoning_content" in c["delta"]
    ]
    assert thoughts == THOUGHTS
    [error] = got.of_type("error")
    assert error["error"]["code"] == "upstream_disconnected"
    assert upstream.requests == 1


async def test_a_response_holds_the_thinking_as_a_reasoning_item_before_its_message():
    async with (
        relay("deepseek") as (url, _),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        stream = await client.responses.create(model="m", input="What is 2 + 2?", stream=True)
        events = [event async for event in stream]
        stored = await client.responses.retrieve(events[-1].response.id)  # type: ignore[union-attr]
        whole = await client.responses.create(model="m", input="What is 2 + 2?", store=False)
    kinds = [event.type for event in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert deltas == THOUGHTS
    # The reasoning item is closed before the message item opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "message"]
    for response in (events[-1].response, stored, whole):  # type: ignore[union-attr]
        reasoning, _ = response.output
        assert reasoning.type == "reasoning" and reasoning.content is not None  # type: ignore[union-attr]
        assert reasoning.content[0].text == "".join(THOUGHTS)  # type: ignore[union-attr]
        assert response.output_text == "".join(ANSWER)
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == len(THOUGHTS)
    # The streamed items are the whole response's, id for id.
    assert [item.id for item in done] == [item.id for item in events[-1].response.output]  # type: ignore[union-attr]


async def test_a_responses_reasoning_item_sent_back_as_input_is_accepted_and_not_prompted():
    # A client keeping its own context (store: false) sends a response's output back whole.
    question: Any = {"role": "user", "content": "What is 2 + 2?"}
    follow_up: Any = {"role": "user", "content": "And 3 + 3?"}
    async with (
        relay("deepseek") as (url, upstream),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        first = await client.responses.create(model="m", input=[question], store=False)
        sent_back: Any = [item.model_dump(exclude_none=True) for item in first.output]
        assert [item["type"] for item in sent_back] == ["reasoning", "message"]
        again = await client.responses.create(
            model="m", input=[question, *sent_back, follow_up], store=False
        )
    assert again.status == "completed" and again.output_text == "".join(ANSWER)
    # The thinking is no part of the prompt: the upstream hears the answer alone.
    assert upstream.bodies[-1]["messages"] == [
        question,
        {"role": "assistant", "content": "".join(ANSWER)},
        follow_up,
    ]


async def test_a_chat_messages_thinking_sent_back_is_accepted_and_not_prompted():
    # The assistant message as this server gave it (reasoning_content), as Vercel's AI SDK
    # sends it back in the next turn's history; and as vLLM spells it (reasoning).
    question: Any = {"role": "user", "content": "What is 2 + 2?"}
    follow_up: Any = {"role": "user", "content": "And 3 + 3?"}
    async with (
        relay("deepseek") as (url, upstream),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        first = await client.chat.completions.create(model="m", messages=[question])
        given: Any = first.choices[0].message.model_dump(exclude_none=True)
        assert given["reasoning_content"] == "".join(THOUGHTS)
        spelled_by_vllm = {"role": "assistant", "content": given["content"], "reasoning": "hm"}
        sent: Any
        for sent in (given, spelled_by_vllm):
            again = await client.chat.completions.create(
                model="m", messages=[question, sent, follow_up]
            )
            assert again.choices[0].message.content == "".join(ANSWER)
            # The thinking is no part of the prompt: the upstream hears the answer alone.
            assert upstream.bodies[-1]["messages"] == [
                question,
                {"role": "assistant", "content": "".join(ANSWER)},
                follow_up,
            ]
        misplaced_thought: Any = {**question, "reasoning_content": "hm"}
        with pytest.raises(openai.BadRequestError) as misplaced:
            await client.chat.completions.create(model="m", messages=[misplaced_thought])
    assert misplaced.value.body == {
        "message": "only an assistant message may carry reasoning_content",
        "type": "invalid_request_error",
        "param": "messages[0].reasoning_content",
        "code": "invalid_value",
    }


async def test_a_message_with_thinking_enabled_has_a_thinking_block_before_its_text():
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    async with (
        relay("vllm") as (url, _),
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client,
    ):
        async with client.messages.stream(
            model="m", max_tokens=2048, messages=ASK, thinking=thinking
        ) as stream:
            pieces = [
                (event.type, getattr(event, "thinking", None) or getattr(event, "text", None))
                async for event in stream
                if event.type in ("thinking", "text")
            ]
            streamed = await stream.get_final_message()
        whole = await client.messages.create(
            model="m", max_tokens=2048, messages=ASK, thinking=thinking
        )
        # The blocks sent back as history, as a client does: the thinking block is accepted,
        # and is no part of the prompt.
        history: Any = [*ASK, {"role": "assistant", "content": whole.content}]
        history.append({"role": "user", "content": "And 3 + 3?"})
        again = await client.messages.create(
            model="m", max_tokens=2048, messages=history, thinking=thinking
        )
    assert pieces == [("thinking", t) for t in THOUGHTS] + [("text", a) for a in ANSWER]
    for message in (streamed, whole, again):
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "".join(THOUGHTS)  # type: ignore[union-attr]
        assert message.content[1].text == "".join(ANSWER)  # type: ignore[union-attr]


async def test_a_thinking_display_is_taken_omitted_sends_the_blocks_without_their_text():
    """``thinking.display`` (Anthropic's current thinking configs have it, and clients send
    it) was an unknown field, a 400. ``summarized`` shows the thinking as before; ``omitted``
    sends each thinking block with its ``thinking`` empty and no ``thinking_delta``, as
    Anthropic's API does, streamed and whole."""
    async with (
        relay("vllm") as (url, _),
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client,
    ):
        shown: dict[str, Any] = {}
        for display in ("summarized", "omitted"):
            configs: list[Any] = [
                {"type": "enabled", "budget_tokens": 1024, "display": display},
                {"type": "adaptive", "display": display},
            ]
            for thinking in configs:
                ask: Any = {"model": "m", "max_tokens": 2048, "messages": ASK}
                async with client.messages.stream(**ask, thinking=thinking) as stream:
                    kinds = [event.type async for event in stream]
                    streamed = await stream.get_final_message()
                whole = await client.messages.create(**ask, thinking=thinking)
                for message in (streamed, whole):
                    blocks = [(b.type, getattr(b, "thinking", None)) for b in message.content]
                    assert blocks[0] == shown.setdefault(display, blocks[0]), thinking
                    assert blocks[1:] == [("text", None)], thinking
                    assert message.usage.output_tokens == 5, thinking  # counted all the same
                thoughts = kinds.count("thinking")
                assert thoughts == (len(THOUGHTS) if display == "summarized" else 0), kinds
    assert shown == {
        "summarized": ("thinking", "".join(THOUGHTS)),
        "omitted": ("thinking", ""),
    }


async def test_text_held_back_goes_out_before_the_thinking_that_follows_it():
    """Text, thinking, text: text held for a window or a stop string's possible start is let
    out before the thinking, so the streamed blocks are the whole message's, in its order."""
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    held: list[dict[str, Any]] = [
        {"extra_body": {"replystream": {"holdback_tokens": 2}}},
        {"stop_sequences": ["answer X"]},  # "answer " could begin it: held until it cannot
        {"extra_body": {"replystream": {"batch_tokens": 8}}},  # batched, none held back
    ]
    async with (
        relay("interleaved") as (url, _),
        anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client,
    ):
        for extra in held:
            async with client.messages.stream(
                model="m", max_tokens=2048, messages=ASK, thinking=thinking, **extra
            ) as stream:
                streamed = await stream.get_final_message()
            whole = await client.messages.create(
                model="m", max_tokens=2048, messages=ASK, thinking=thinking, **extra
            )
            for message in (streamed, whole):
                blocks = [(b.type, getattr(b, "text", None)) for b in message.content]
                assert blocks == [("text", ANSWER[0]), ("thinking", None), ("text", ANSWER[1])]


async def test_thinking_settings_are_checked_as_anthropic_checks_them():
    async with relay("vllm") as (url, upstream):
        for thinking, max_tokens in (
            ({"type": "enabled", "budget_tokens": 1023}, 4096),  # below Anthropic's minimum
            ({"type": "enabled", "budget_tokens": 4096}, 4096),  # not below max_tokens
            ({"type": "enabled"}, 4096),  # no budget
            ({"type": "disabled", "budget_tokens": 2048}, 4096),
            ({"type": "sometimes"}, 4096),
        ):
            body = {"model": "m", "max_tokens": max_tokens, "messages": ASK, "thinking": thinking}
            got = await post_events(f"{url}/v1/messages", body)
            assert got.status == 400, (thinking, got.raw)
            error = json.loads(got.raw)
            assert error["type"] == "error", thinking
            assert error["error"]["type"] == "invalid_request_error", thinking
            assert "thinking" in error["error"]["message"], (thinking, error)
        user_thinking = [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]
        body = {"model": "m", "max_tokens": 64, "messages": user_thinking}
        got = await post_events(f"{url}/v1/messages", body)
        assert got.status == 400 and "assistant" in json.loads(got.raw)["error"]["message"]
    assert upstream.requests == 0


async def test_chat_reasoning_effort_is_passed_to_the_upstream_as_given():
    async with (
        relay("deepseek") as (url, upstream),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        await client.chat.completions.create(model="m", messages=ASK, reasoning_effort="high")
        await client.chat.completions.create(model="m", messages=ASK)
    assert upstream.bodies[0]["reasoning_effort"] == "high"
    assert "reasoning_effort" not in upstream.bodies[1]


def test_a_response_read_mid_thought_shows_its_thinking_so_far():
    # GET /v1/responses/{id} while it streams builds the object from its logged events.
    fmt = ResponsesStreamFormat(ResponseSettings(model="m", created_at=0))
    specs = fmt.started("r1") + fmt.reasoning("Two and ", 1) + fmt.reasoning("two", 1)
    entries = [LogEntry(number, event, data) for number, (event, data) in enumerate(specs, 1)]
    response = response_from_log(entries, producer_lost=False)
    assert response is not None and response["status"] == "in_progress"
    [item] = response["output"]
    assert item["type"] == "reasoning" and item["status"] == "in_progress"
    assert item["content"] == [{"type": "reasoning_text", "text": "Two and two"}]
    # Text closes the item; the whole response has it before the message.
    specs = fmt.text("Four.", 1) + fmt.finished("stop", Usage(3, 3, 2))
    whole = json.loads(specs[-1][1])["response"]
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}


async def test_the_measuring_client_times_thinking_as_output_and_keeps_it_apart():
    chat = {"model": "m", "messages": ASK, "stream": True}
    bodies = {
        "/v1/chat/completions": {**chat, "stream_options": {"include_usage": True}},
        "/v1/replies": {"prompt": "2 + 2?", "stream": True},
        "/v1/responses": {"model": "m", "input": "2 + 2?", "stream": True},
    }
    async with relay("vllm") as (url, _):
        for route, body in bodies.items():
            timing = await measure_reply(f"{url}{route}", method="POST", json_body=body)
            assert timing.complete, (route, timing.error)
            assert timing.text == "".join(ANSWER) and timing.thinking == "".join(THOUGHTS)
            # Output began with the thinking; the answer came after all of it.
            assert timing.first_text_ms is not None and timing.first_answer_ms is not None
            assert timing.first_answer_ms - timing.first_text_ms >= 2 * THINK_S * 1000, route
            assert len(timing.text_event_ms) == len(THOUGHTS) + len(ANSWER), route


async def test_a_responses_reasoning_effort_is_passed_on_and_repeated_in_the_response():
    async with (
        relay("deepseek") as (url, upstream),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as client,
    ):
        asked = await client.responses.create(
            model="m", input="2 + 2?", reasoning={"effort": "low", "summary": "auto"}
        )
        plain = await client.responses.create(model="m", input="2 + 2?")
        refused = await post_events(
            f"{url}/v1/responses",
            {"model": "m", "input": "2 + 2?", "reasoning": {"summary": "brief"}},
        )
    assert upstream.bodies[0]["reasoning_effort"] == "low"
    assert "reasoning_effort" not in upstream.bodies[1]
    assert asked.reasoning is not None
    assert (asked.reasoning.effort, asked.reasoning.summary) == ("low", "auto")
    assert plain.reasoning is not None and plain.reasoning.effort is None
    # The summary asked for is the thinking itself, whole, in the reasoning item.
    assert asked.output[0].type == "reasoning" and asked.output[0].summary == []
    assert refused.status == 400
    assert json.loads(refused.raw)["error"]["param"] == "reasoning.summary"


async def test_a_websocket_reply_carries_the_thinking_as_its_own_messages():
    async with relay("deepseek") as (url, _), aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "reply", "id": "t", "prompt": "2 + 2?"})
            messages = await read_until_ended(ws, {"t"})
    kinds = [m["type"] for m in messages if m["type"] in ("thinking", "token")]
    assert kinds == ["thinking"] * len(THOUGHTS) + ["token"] * len(ANSWER)
    assert [m["data"]["text"] for m in messages if m["type"] == "thinking"] == THOUGHTS
    assert messages[-1]["type"] == "done"
