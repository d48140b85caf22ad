"""llama.cpp's server's errors mid-stream, through the relay: its builds before October 2025
wrote one as an ``error: {...}`` line (a field the event-stream standard ignores), then
``data: [DONE]``; the client must be told what the upstream said, not that a ``[DONE]`` came
without a finish reason."""

from __future__ import annotations

import json

from aiohttp import web

from replystream.sse import EventParser
from tests.chat_upstream import ChatUpstream, relaying_to, reply_with
from tests.sse_client import post_events

CONTEXT_ERROR = (
    b'error: {"code":400,"message":"the request exceeds the available context size, try '
    b'increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}'
    b"\n\n"
)


def chunk(delta: dict[str, object]) -> bytes:
    body = {
        "choices": [{"finish_reason": None, "index": 0, "delta": delta}],
        "created": 1765000000,
        "id": "chatcmpl-abc",
        "model": "m",
        "object": "chat.completion.chunk",
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class OldLlamaCppServer(ChatUpstream):
    """Writes a reply's text (if any), then its error as llama.cpp's server did, then
    ``[DONE]``."""

    def __init__(self, text: str, error: bytes) -> None:
        self.text, self.error = text, error

    async def chat(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.text:
            await response.write(chunk({"content": self.text}))
        await response.write(self.error)
        await response.write(b"data: [DONE]\n\n")
        return response


async def relayed(upstream: ChatUpstream) -> tuple[str, dict[str, str]]:
    async with relaying_to(upstream) as url:
        got = await post_events(
            f"{url}/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
    assert got.status == 200
    errors = got.of_type("error")
    assert len(errors) == 1, got.raw
    return got.chat_text, errors[0]["error"]


async def test_an_error_line_before_any_text_is_relayed_as_its_error():
    text, error = await relayed(OldLlamaCppServer("", CONTEXT_ERROR))
    assert text == ""
    assert "the request exceeds the available context size" in error["message"], error
    assert "[DONE]" not in error["message"]


async def test_an_error_line_after_text_is_relayed_after_the_text():
    said = b'error: {"code":500,"message":"Failed to parse input","type":"server_error"}\n\n'
    text, error = await relayed(OldLlamaCppServer("Hello", said))
    assert text == "Hello"
    assert error["code"] == "upstream_error"
    assert error["message"].endswith("reported an error mid-reply: Failed to parse input")


def test_the_error_field_is_read_only_when_asked_for():
    line = b'error: {"message":"x"}\n\n'
    assert EventParser().feed(line) == []  # the standard's reading: an unknown field
    (event,) = EventParser(error_field=True).feed(line)
    assert (event.type, event.data) == ("error", '{"message":"x"}')


class ContextRefusingServer(OldLlamaCppServer):
    """Refuses in its stream every prompt but ``hi``, as past its context."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["messages"][-1]["content"] == "hi":
            return await reply_with(request, "Hello")
        return await super().chat(request)


async def test_a_prompt_refused_in_the_stream_as_past_the_context_is_the_clients_to_fix():
    async with relaying_to(ContextRefusingServer("", CONTEXT_ERROR)) as url:
        for _ in range(4):  # past the failures that open a circuit (3 by default)
            got = await post_events(
                f"{url}/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "long"}], "stream": True},
            )
            (error,) = [e["error"] for e in got.of_type("error")]
            assert error["code"] == "context_length_exceeded", error
            assert error["type"] == "invalid_request_error"  # not the server's to retry
            assert (
                "refused the request: the request exceeds the available context"
                in (error["message"])
            )
        messages = await post_events(
            f"{url}/v1/messages",
            {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "long"}],
                "stream": True,
            },
        )
        (said,) = messages.of_type("error")
        assert said["error"]["type"] == "invalid_request_error", said
        assert said["error"]["code"] == "context_length_exceeded"
        whole = await post_events(
            f"{url}/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "long"}]},
        )
        got = await post_events(
            f"{url}/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
    assert got.status == 200 and got.chat_text == "Hello", got.raw
    # Not streamed, the refusal is the client's 400, as a refusal before the stream is.
    assert whole.status == 400, whole.raw
    error = json.loads(whole.raw)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
