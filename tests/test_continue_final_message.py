"""``continue_final_message`` (vLLM's field) on our own chat route: the final assistant message
is the start of the reply, and the reply is what follows it; what a relay sends when it
continues a cut reply at another upstream."""

from __future__ import annotations

import json

from replystream.engine.simulated import ARTICLE_REPLY
from tests.conftest import fast_engine, serve_engine
from tests.sse_client import post_events


def chat(*messages: tuple[str, str], **extra: object) -> dict[str, object]:
    return {"messages": [{"role": r, "content": c} for r, c in messages], **extra}


async def test_a_final_assistant_message_is_continued_not_repeated():
    words = ARTICLE_REPLY.split()
    async with serve_engine(fast_engine(reply_text=ARTICLE_REPLY)) as url:
        prefix = " ".join(words[:4]) + " "
        body = chat(("user", "hi"), ("assistant", prefix), continue_final_message=True)
        got = await post_events(f"{url}/v1/chat/completions", {**body, "max_tokens": 3})
        reply = json.loads(got.raw)["choices"][0]["message"]["content"]
        assert reply == " ".join(words[4:7]) + " "
        whole = await post_events(
            f"{url}/v1/chat/completions", chat(("user", "hi"), continue_final_message=False)
        )
        assert json.loads(whole.raw)["choices"][0]["message"]["content"].startswith(words[0])


async def test_a_final_assistant_message_holding_the_whole_reply_gets_an_empty_completion():
    """Nothing is left to make: the reply is empty and finishes ``stop``, streamed (the role
    chunk, the finish chunk and ``[DONE]``, no error) and whole. The simulated engine pushes
    a streamed reply and ends it inside ``attach``, before the reader has joined; the
    reply's log must outlive that, and the whole reply must not index past the text."""
    async with serve_engine(fast_engine(reply_text=ARTICLE_REPLY)) as url:
        body = chat(("user", "hi"), ("assistant", ARTICLE_REPLY), continue_final_message=True)
        streamed = await post_events(f"{url}/v1/chat/completions", {**body, "stream": True})
        assert streamed.status == 200
        assert "error" not in streamed.types
        assert [event.data for event in streamed.events][-1] == "[DONE]"
        chunks = [json.loads(event.data) for event in streamed.events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
        assert streamed.chat_text == ""
        whole = await post_events(f"{url}/v1/chat/completions", body)
        assert whole.status == 200
        reply = json.loads(whole.raw)
        assert reply["choices"][0]["message"]["content"] == ""
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == 0


async def test_continue_final_message_needs_an_assistant_message_last_and_no_generation_prompt():
    async with serve_engine(fast_engine()) as url:
        for body, param in (
            (chat(("user", "hi"), continue_final_message=True), "continue_final_message"),
            (
                chat(
                    ("user", "hi"),
                    ("assistant", "A"),
                    continue_final_message=True,
                    add_generation_prompt=True,
                ),
                "add_generation_prompt",
            ),
        ):
            got = await post_events(f"{url}/v1/chat/completions", body)
            assert got.status == 400
            assert json.loads(got.raw)["error"]["param"] == param
