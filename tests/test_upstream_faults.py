"""The upstream relay against a misbehaving upstream: every failure is contained and bounded.

The upstream is a small aiohttp app in this file; the mode is the first path segment of its
base URL (``http://127.0.0.1:PORT/<mode>/v1``). replystream serves an ``UpstreamEngine``
pointed at it on a real loopback socket, and the test reads our OpenAI stream as a client does.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import signal
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partialmethod
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
from aiohttp import web

from replystream.delivery.redis_store import RedisReplayStore
from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.engine.upstream_pool import Backend, BreakerConfig, UpstreamPool
from replystream.engine.upstream_refusals import UpstreamTimeout, UpstreamUnavailable
from replystream.engine.upstream_request import request_body
from replystream.server import create_app, running
from tests.chat_upstream import ChatUpstream, reply_with
from tests.conftest import wait_for
from tests.rawhttp import raw_request
from tests.redis_server import redis_server
from tests.services import free_port
from tests.sse_client import post_events

STALL_S = 0.4
SILENCE_S = 1.0  # an upstream's silence: past STALL_S, within the limits that apply
MAX_EVENT = 4096
HEAD_DELAY_S = 0.6  # an upstream's wait before its head, and again before its first text
CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


TOOL_PIECES: list[dict[str, Any]] = [
    {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}},
    {"index": 0, "function": {"arguments": ": 1}"}},
]


def chunk(
    content: str | None = None,
    finish: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    choice_extra: dict[str, Any] | None = None,
    **extra: Any,
) -> bytes:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice = {"index": 0, "delta": delta, "finish_reason": finish, **(choice_extra or {})}
    body = {"object": "chat.completion.chunk", "choices": [choice], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FakeUpstream:
    """Scripted upstream behaviours; remembers what it was sent and whether it was cut off."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.disconnected = asyncio.Event()
        self.transport: asyncio.Transport | None = None  # the latest request's

    async def chat(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        self.transport = request.transport
        if mode == "slowhead":
            await asyncio.sleep(30)
        if mode == "latehead":
            await asyncio.sleep(HEAD_DELAY_S)
        if mode == "dripfail":  # a 500 whose body comes a byte at a time, never ending
            failing = web.StreamResponse(status=500, headers={"Content-Type": "application/json"})
            await failing.prepare(request)
            for _ in range(300):
                await failing.write(b" ")
                await asyncio.sleep(0.1)
            return failing
        if mode == "reject":
            error = {"message": "prompt too long", "code": "context_length_exceeded"}
            return web.json_response({"error": error}, status=400)
        top_p = self.bodies[-1].get("top_p", 1.0)
        if mode == "vllm" and not 0 < top_p <= 1:  # vLLM's range, and its refusal's shape
            message = f"top_p must be in (0, 1], got {float(top_p)}."
            error = {"object": "error", "message": message, "type": "BadRequestError"}
            return web.json_response({**error, "param": None, "code": 400}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await getattr(self, "mode_" + mode)(response)
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return response

    async def mode_ok(self, r: web.StreamResponse) -> None:
        await r.write(chunk("", role="assistant"))
        for word in ("one ", "two ", "three "):
            await r.write(chunk(word))
        await r.write(chunk(None, "stop"))
        usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        await r.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")

    mode_vllm = mode_ok  # but for what it refuses, as vLLM does

    async def mode_afterfinish(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one ") + chunk("two ", "stop"))
        await r.write(chunk("three ") + chunk(None, tool_calls=TOOL_PIECES[:1]))
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        await r.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")

    async def mode_nullchoices(self, r: web.StreamResponse) -> None:
        # Usage-only chunks whose choices is null, not [] (as some hosted OpenAI-compatible
        # services send them): one before the text, one within it, one after the finish.
        await r.write(b'data: {"choices": null, "usage": null}\n\n')
        await r.write(chunk("one ") + b'data: {"id": "c", "choices": null}\n\n' + chunk("two "))
        await r.write(chunk(None, "stop"))
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        await r.write(b"data: " + json.dumps({"choices": None, "usage": usage}).encode())
        await r.write(b"\n\ndata: [DONE]\n\n")

    async def mode_errmid(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one ") + chunk("two "))
        await r.write(b'data: {"error": {"message": "out of memory", "code": 500}}\n\n')
        await asyncio.sleep(30)

    async def _error_event(self, data: bytes, r: web.StreamResponse) -> None:
        """Text, then an ``event: error`` whose data is ``data`` (not replystream's shape)."""
        await r.write(chunk("one ") + b"event: error\ndata: " + data + b"\n\n")
        await asyncio.sleep(30)

    # A proxy's own shape, with a message at the top; one with none (a server's internals);
    # one that is not JSON at all (a traceback).
    mode_errevent_message = partialmethod(_error_event, b'{"message": "model unloaded"}')
    mode_errevent_internals = partialmethod(
        _error_event, b'{"type": "EngineDeadError", "trace": "File /srv/engine.py, line 3"}'
    )
    mode_errevent_text = partialmethod(_error_event, b"Traceback: File /srv/engine.py, line 3")

    async def mode_stall(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one "))
        await asyncio.sleep(30)

    async def mode_malformed(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one "))
        for _ in range(10_000):  # lines without a colon are fields SSE ignores: no event, ever
            await r.write(b'data{"choices": [{"delta": {"content": "x"}}]}\n')
            await asyncio.sleep(0.001)

    async def mode_notjson(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one ") + b"data: this is not json\n\n")
        await asyncio.sleep(30)

    async def mode_endless(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one ") + b"data: ")
        for _ in range(10_000):  # one event that never ends
            await r.write(b"x" * 256)
            await asyncio.sleep(0.001)

    async def mode_tools(self, r: web.StreamResponse) -> None:
        # vLLM's style: the naming piece already carries arguments.
        for call in TOOL_PIECES:
            await r.write(chunk(None, tool_calls=[call]))
        await r.write(chunk(None, "tool_calls") + b"data: [DONE]\n\n")

    async def mode_badtool(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one ") + chunk(None, tool_calls=[{"index": "first"}]))
        await asyncio.sleep(30)

    async def mode_slowfirst(self, r: web.StreamResponse) -> None:
        # Its head and a role chunk at once, then silence (a model thinking without saying
        # so) for longer than the stall limit, then the reply.
        await r.write(chunk("", role="assistant"))
        await asyncio.sleep(SILENCE_S)
        await r.write(chunk("one ") + chunk(None, "stop") + b"data: [DONE]\n\n")

    async def mode_latehead(self, r: web.StreamResponse) -> None:
        # Its head after HEAD_DELAY_S (``chat``), then as long again to its first text.
        await asyncio.sleep(HEAD_DELAY_S)
        await r.write(chunk("late ") + chunk(None, "stop") + b"data: [DONE]\n\n")

    async def mode_pause(self, r: web.StreamResponse) -> None:
        # Text, silence for longer than the relay's stall limit, then the rest.
        await r.write(chunk("one "))
        await asyncio.sleep(SILENCE_S)
        await r.write(chunk("two ") + chunk(None, "stop") + b"data: [DONE]\n\n")

    async def mode_eof(self, r: web.StreamResponse) -> None:
        await r.write(chunk("one "))

    async def mode_thinking(self, r: web.StreamResponse) -> None:
        # A reasoning model (vLLM's reasoning parsers, DeepSeek's API): its thinking streams
        # as reasoning_content, for longer than the TTFT limit, before the first text.
        await r.write(chunk("", role="assistant"))
        for _ in range(12):
            delta = {"reasoning_content": "hmm "}
            choice = {"index": 0, "delta": delta, "finish_reason": None}
            await r.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            await asyncio.sleep(0.1)
        await r.write(chunk("one ") + chunk(None, "stop") + b"data: [DONE]\n\n")

    async def mode_cutafterfinish(self, r: web.StreamResponse) -> None:
        # The finishing chunk came; the connection breaks before the usage and [DONE].
        await r.write(chunk("one ") + chunk(None, "stop"))
        await asyncio.sleep(0.05)
        assert self.transport is not None
        self.transport.abort()  # no chunked terminator: the body is cut, not ended

    async def mode_hangafterfinish(self, r: web.StreamResponse) -> None:
        # The finishing chunk came; then nothing (no usage, no [DONE]) past the stall limit.
        await r.write(chunk("one ") + chunk("two ") + chunk(None, "stop"))
        await asyncio.sleep(30)

    async def _cut_at_stop(self, named: dict[str, Any], r: web.StreamResponse) -> None:
        """A reply the upstream finished ``stop``, its finishing choice naming what it
        stopped at (vLLM's and SGLang's fields) as ``named`` says."""
        await r.write(chunk("", choice_extra={"stop_reason": None}, role="assistant"))
        await r.write(chunk("one ", choice_extra={"stop_reason": None}) + chunk("two "))
        await r.write(chunk(None, "stop", choice_extra=named) + b"data: [DONE]\n\n")

    # vLLM's ``stop_reason`` and SGLang's ``matched_stop``: the stop string matched, a stop
    # token's id (EOS), or something that is not one of the request's stop strings.
    mode_vllmstop = partialmethod(_cut_at_stop, {"stop_reason": "three"})
    mode_sglangstop = partialmethod(_cut_at_stop, {"matched_stop": "three"})
    mode_tokenstop = partialmethod(_cut_at_stop, {"stop_reason": 128009})
    mode_otherstop = partialmethod(_cut_at_stop, {"stop_reason": "<|im_end|>"})
    mode_liststop = partialmethod(_cut_at_stop, {"matched_stop": ["three"]})
    mode_unnamed = partialmethod(_cut_at_stop, {})  # llama.cpp, TGI, Ollama: no such field

    async def _with_usage(self, usage: dict[str, Any] | None, r: web.StreamResponse) -> None:
        await r.write(chunk("one ") + chunk("two ") + chunk(None, "stop"))
        if usage is not None:
            body = {"choices": [], "usage": usage}
            await r.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")

    mode_nousage = partialmethod(_with_usage, None)
    mode_ownusage = partialmethod(_with_usage, {"prompt_tokens": 7, "completion_tokens": 5})
    # Counts that are none: booleans (integers to Python, not to JSON), past any real count.
    mode_boolusage = partialmethod(_with_usage, {"prompt_tokens": True, "completion_tokens": True})
    mode_hugeusage = partialmethod(
        _with_usage, {"prompt_tokens": 2**53, "completion_tokens": 2**53}
    )

    async def mode_oddlogprobs(self, r: web.StreamResponse) -> None:
        # Python servers write json.dumps's NaN and Infinity; a huge number reads as either.
        for word, logprob in ODD_LOGPROBS:
            entry = f'{{"token":"{word}","logprob":{logprob},"top_logprobs":[]}}'
            tops = f'[{{"token":"x","logprob":NaN}},{{"token":"{word}","logprob":-0.5}}]'
            top = f'{{"token":"{word}","logprob":-0.5,"top_logprobs":{tops}}}'
            content = f"[{entry},{top}]" if logprob != "-0.5" else f"[{top}]"
            logprobs = f'{{"content":{content}}}'
            choice = f'{{"index":0,"delta":{{"content":"{word}"}},"logprobs":{logprobs}}}'
            await r.write(f'data: {{"choices":[{choice}]}}\n\n'.encode())
        await r.write(chunk(None, "stop") + b"data: [DONE]\n\n")

    async def mode_forever(self, r: web.StreamResponse) -> None:
        for i in range(10_000):
            await r.write(chunk(f"w{i} "))
            await asyncio.sleep(0.01)


@asynccontextmanager
async def fake_upstream() -> AsyncIterator[tuple[FakeUpstream, str]]:
    """The fake upstream on a loopback port; yields it and its root URL."""
    fake = FakeUpstream()
    app = web.Application()
    app.router.add_post("/{mode}/v1/chat/completions", fake.chat)
    async with running(app) as url:
        yield fake, url


async def relay_mode(mode: str):
    """One streamed chat request through a relay in front of the fake upstream's ``mode``."""
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(
            UpstreamConfig(
                targets=(UpstreamTarget(f"{upstream}/{mode}/v1"),),
                model="m",
                stall_s=STALL_S,
                max_event_size=MAX_EVENT,
                headers_timeout_s=0.5,
            )
        )
        async with running(create_app(engine)) as relay:
            started = time.monotonic()
            got = await post_events(f"{relay}/v1/chat/completions", CHAT)
            return got, time.monotonic() - started, fake


async def test_output_after_the_finish_reason_is_dropped_and_its_usage_kept(caplog):
    """A reply the upstream said had ended is not added to: a client has its finish, and
    text after it would arrive after its own finish_reason (or be made part of a reply
    that says it stopped)."""
    async with fake_upstream() as (_, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/afterfinish/v1"),)))
        async with running(create_app(engine)) as relay:
            body = {**CHAT, "stream_options": {"include_usage": True}}
            got = await post_events(f"{relay}/v1/chat/completions", body)
    assert got.status == 200 and got.chat_text == "one two "
    payloads = [json.loads(e.data) for e in got.events if e.data != "[DONE]"]
    assert not any(c["delta"].get("tool_calls") for p in payloads for c in p["choices"])
    assert [c["finish_reason"] for p in payloads for c in p["choices"]][-1] == "stop"
    assert payloads[-1]["usage"]["completion_tokens"] == 2
    warnings = [
        r.getMessage() for r in caplog.records if "after its finish reason" in r.getMessage()
    ]
    assert warnings == [
        f"the upstream at {upstream}/afterfinish/v1 sent output after its finish reason; dropped it"
    ]


def error_of(got) -> dict[str, Any]:
    errors = got.of_type("error")
    assert len(errors) == 1, got.raw
    assert "[DONE]" not in got.raw.decode()
    error: dict[str, Any] = errors[0]["error"]
    return error


async def test_a_clean_upstream_reply_is_relayed_with_its_usage_and_finish_reason():
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(
            UpstreamConfig((UpstreamTarget(f"{upstream}/ok/v1"),), model="m", api_key="k1")
        )
        async with running(create_app(engine)) as relay:
            body = {**CHAT, "stream_options": {"include_usage": True}, "seed": 5, "top_k": 7}
            body["min_p"] = 0.05
            got = await post_events(f"{relay}/v1/chat/completions", body)
    assert got.status == 200
    assert got.chat_text == "one two three "
    payloads = [json.loads(e.data) for e in got.events if e.data != "[DONE]"]
    assert payloads[-1]["usage"]["completion_tokens"] == 5  # the upstream's count, not ours
    assert [c["finish_reason"] for p in payloads for c in p["choices"]][-1] == "stop"
    sent = fake.bodies[0]
    assert sent["messages"] == CHAT["messages"] and sent["model"] == "m"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["seed"] == 5 and sent["top_k"] == 7 and sent["min_p"] == 0.05
    assert fake.headers[0]["Authorization"] == "Bearer k1"


async def test_a_chunk_whose_choices_is_null_is_a_chunk_with_no_choices():
    async with fake_upstream() as (_, upstream):
        target = UpstreamTarget(f"{upstream}/nullchoices/v1")
        async with running(create_app(UpstreamEngine(UpstreamConfig((target,))))) as relay:
            body = {**CHAT, "stream_options": {"include_usage": True}}
            got = await post_events(f"{relay}/v1/chat/completions", body)
    assert got.status == 200 and not got.of_type("error"), got.raw
    assert got.chat_text == "one two "
    payloads = [json.loads(e.data) for e in got.events if e.data != "[DONE]"]
    assert [c["finish_reason"] for p in payloads for c in p["choices"]][-1] == "stop"
    assert payloads[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


async def test_an_error_chunk_mid_reply_becomes_an_in_band_error_after_the_text():
    got, _, _ = await relay_mode("errmid")
    assert got.chat_text == "one two "
    error = error_of(got)
    assert error["code"] == "upstream_error" and "out of memory" in error["message"]


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("errevent_message", "reported an error mid-reply: model unloaded"),
        ("errevent_internals", "reported an error mid-reply: no message given"),
        (
            "errevent_text",
            "reported an error mid-reply, in an event that is not a JSON object (38 characters)",
        ),
    ],
)
async def test_an_error_event_is_told_in_our_words_quoting_only_its_message(mode: str, said: str):
    got, _, _ = await relay_mode(mode)
    assert got.chat_text == "one "
    error = error_of(got)
    assert error["code"] == "upstream_error"
    assert error["message"].endswith(f"/{mode}/v1 {said}"), error
    assert "/srv/engine.py" not in got.raw.decode()


async def test_a_stalled_upstream_ends_the_reply_within_the_stall_limit():
    got, took, fake = await relay_mode("stall")
    assert got.chat_text == "one "
    assert error_of(got)["code"] == "upstream_stalled"
    assert STALL_S <= took < STALL_S + 2.0
    await wait_for(fake.disconnected.is_set)  # and the upstream connection was closed


async def test_malformed_sse_ends_the_reply_once_the_byte_bound_passes():
    got, took, fake = await relay_mode("malformed")
    assert got.chat_text == "one "
    assert error_of(got)["code"] == "upstream_malformed"
    assert took < 5.0
    await wait_for(fake.disconnected.is_set)


async def test_a_chunk_that_is_not_json_is_an_in_band_error():
    got, _, _ = await relay_mode("notjson")
    assert got.chat_text == "one "
    error = error_of(got)
    assert error["code"] == "upstream_bad_chunk" and "not JSON" in error["message"]


async def test_an_upstreams_tool_call_pieces_are_relayed_as_they_came():
    got, _, _ = await relay_mode("tools")
    chunks = [json.loads(e.data) for e in got.events if e.type == "message" and e.data != "[DONE]"]
    calls = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert calls == TOOL_PIECES
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_malformed_tool_call_is_an_in_band_error_after_the_text():
    got, _, _ = await relay_mode("badtool")
    assert got.chat_text == "one "
    error = error_of(got)
    assert error["code"] == "upstream_bad_chunk" and "tool call" in error["message"]


async def test_an_event_that_never_ends_is_cut_at_the_event_size_limit():
    got, took, fake = await relay_mode("endless")
    assert got.chat_text == "one "
    assert error_of(got)["code"] == "upstream_event_too_large"
    assert took < 5.0
    await wait_for(fake.disconnected.is_set)


async def test_an_upstream_that_ends_without_finishing_is_an_incomplete_reply():
    got, _, _ = await relay_mode("eof")
    assert got.chat_text == "one "
    assert error_of(got)["code"] == "upstream_incomplete"


async def test_a_body_cut_after_the_finishing_chunk_is_a_finished_reply():
    # The reply was whole when its finish reason came: what broke after it (the usage and
    # [DONE] still to come) loses nothing, so it is no error, nor a reply to continue.
    got, _, _ = await relay_mode("cutafterfinish")
    assert got.chat_text == "one "
    assert not got.of_type("error"), got.raw
    payloads = [json.loads(e.data) for e in got.events if e.data != "[DONE]"]
    assert [c["finish_reason"] for p in payloads for c in p["choices"]][-1] == "stop"
    assert got.events[-1].data == "[DONE]"


@pytest.mark.parametrize("continuation", [False, True])
async def test_silence_after_the_finishing_chunk_ends_a_finished_reply(continuation: bool):
    """The upstream sent its finish reason, then nothing: the reply was whole, so past the
    stall limit it ends as finished (streamed and whole), neither a stall to report nor a
    reply to continue elsewhere, and the upstream is not counted as failing."""
    async with fake_upstream() as (fake, upstream):
        targets = (
            UpstreamTarget(f"{upstream}/hangafterfinish/v1", 100),
            UpstreamTarget(f"{upstream}/ok/v1", 1),
        )
        config = UpstreamConfig(
            targets if continuation else targets[:1],
            model="m",
            stall_s=STALL_S,
            continuation=continuation,
        )
        engine = UpstreamEngine(config)
        async with running(create_app(engine)) as relay:
            got = await post_events(f"{relay}/v1/chat/completions", CHAT)
            async with aiohttp.ClientSession() as http:
                whole_body = {**CHAT, "stream": False}
                async with http.post(f"{relay}/v1/chat/completions", json=whole_body) as r:
                    whole = (r.status, await r.json())
            stats = engine.stats()
    assert got.chat_text == "one two ", got.raw
    assert not got.of_type("error"), got.raw
    payloads = [json.loads(e.data) for e in got.events if e.data != "[DONE]"]
    assert [c["finish_reason"] for p in payloads for c in p["choices"]][-1] == "stop"
    assert got.events[-1].data == "[DONE]"
    assert whole[0] == 200, whole
    assert whole[1]["choices"][0]["message"]["content"] == "one two "
    assert whole[1]["choices"][0]["finish_reason"] == "stop"
    assert len(fake.bodies) == 2  # nothing was sent to the second upstream to continue
    assert stats.continuations == 0
    assert dict(stats.backends[0].attempts) == {"ok": 2}  # not counted as a stall


async def test_a_model_thinking_past_the_ttft_and_stall_limits_is_not_cut():
    # Its reasoning is the upstream at work (relayed here, as chat's reasoning_content): it
    # counts as the attempt's progress, so neither limit runs out while it streams.
    async with fake_upstream() as (fake, upstream):
        target = UpstreamTarget(f"{upstream}/thinking/v1")
        config = UpstreamConfig((target,), model="m", ttft_s=0.5, stall_s=0.5)
        async with running(create_app(UpstreamEngine(config))) as relay:
            got = await post_events(f"{relay}/v1/chat/completions", CHAT)
    assert not got.of_type("error"), got.raw
    assert got.chat_text == "one "
    assert len(fake.bodies) == 1  # no failover


@pytest.mark.parametrize(
    ("mode", "relay_ttft_s", "own_ttft_s", "own_stall_s", "text"),
    [
        # Before the first text only the TTFT bound applies: the relay's...
        ("slowfirst", 3.0, None, None, "one "),
        # ... or the upstream's own, over the relay's.
        ("slowfirst", STALL_S, 3.0, None, "one "),
        # After it, the upstream's own stall limit, over the relay's.
        ("pause", 30.0, None, 3.0, "one two "),
    ],
)
async def test_an_upstream_silent_within_the_limits_that_apply_to_it_is_not_cut(
    mode: str,
    relay_ttft_s: float,
    own_ttft_s: float | None,
    own_stall_s: float | None,
    text: str,
):
    # The relay's stall limit (STALL_S) is shorter than each silence here.
    async with fake_upstream() as (fake, upstream):
        target = UpstreamTarget(f"{upstream}/{mode}/v1", ttft_s=own_ttft_s, stall_s=own_stall_s)
        config = UpstreamConfig((target,), model="m", ttft_s=relay_ttft_s, stall_s=STALL_S)
        async with running(create_app(UpstreamEngine(config))) as relay:
            started = time.monotonic()
            got = await post_events(f"{relay}/v1/chat/completions", CHAT)
            took = time.monotonic() - started
    assert not got.of_type("error"), got.raw
    assert got.chat_text == text and took >= SILENCE_S
    assert len(fake.bodies) == 1  # no failover


async def test_usage_counts_that_are_not_counts_are_taken_as_missing():
    async def usage_of(mode: str) -> dict[str, Any]:
        async with fake_upstream() as (_, upstream):
            target = UpstreamTarget(f"{upstream}/{mode}/v1")
            async with running(create_app(UpstreamEngine(UpstreamConfig((target,))))) as relay:
                body = {**CHAT, "stream_options": {"include_usage": True}}
                got = await post_events(f"{relay}/v1/chat/completions", body)
        assert got.chat_text == "one two " and not got.of_type("error"), got.raw
        usage: dict[str, Any] = json.loads(got.events[-2].data)["usage"]
        return usage

    assert await usage_of("ownusage") == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
    }
    missing = await usage_of("nousage")  # our estimate of the prompt, a token per text
    assert missing["completion_tokens"] == 2 and missing["prompt_tokens"] != 7
    assert await usage_of("boolusage") == missing
    assert await usage_of("hugeusage") == missing


async def test_connection_refused_is_502_in_the_error_shape():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(dead),), model="m"))
    async with running(create_app(engine)) as relay:
        got = await post_events(f"{relay}/v1/chat/completions", CHAT)
        whole = await post_events(f"{relay}/v1/replies", {"prompt": "hi", "stream": False})
    for response in (got, whole):
        assert response.status == 502
        error = json.loads(response.raw)["error"]
        assert error["code"] == "upstream_unavailable" and error["type"] == "server_error"


async def test_no_response_head_in_time_is_504_in_the_error_shape():
    got, took, _ = await relay_mode("slowhead")
    assert got.status == 504
    assert json.loads(got.raw)["error"]["code"] == "upstream_timeout"
    assert took < 3.0


async def test_an_upstream_refusal_of_the_request_is_a_400_with_its_message():
    got, _, _ = await relay_mode("reject")
    assert got.status == 400
    error = json.loads(got.raw)["error"]
    assert error["code"] == "context_length_exceeded" and "prompt too long" in error["message"]


async def test_closing_the_stream_closes_the_upstream_connection():
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/forever/v1"),)))
        stream = await engine.start(GenerationRequest("hi"))
        first = await anext(stream)
        assert first.text == "w0 "
        await stream.aclose()
        await wait_for(fake.disconnected.is_set)
        assert engine.stats().cancelled == 1 and engine.stats().active == 0
        await engine.aclose()


async def test_an_upstream_past_the_token_limit_is_cut_there_and_closed():
    """It was sent max_tokens and wrote on (``forever`` ignores it): the client gets that many
    tokens and a finish of ``length``, and the upstream is stopped, read or attached."""
    ask = {**CHAT, "max_tokens": 5, "stream_options": {"include_usage": True}}
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/forever/v1"),)))
        async with running(create_app(engine)) as relay:
            got = await post_events(f"{relay}/v1/chat/completions", ask)
            await wait_for(fake.disconnected.is_set)
            fake.disconnected.clear()
            async with anthropic.AsyncAnthropic(base_url=relay, api_key="k") as claude:
                whole = await claude.messages.create(
                    model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
                )
            await wait_for(fake.disconnected.is_set)
            fake.disconnected.clear()
        read = await engine.start(GenerationRequest("hi", SamplingParams(max_tokens=2)))
        deltas = [delta async for delta in read]
        await wait_for(fake.disconnected.is_set)
        await engine.aclose()
    assert got.chat_text == "w0 w1 w2 w3 w4 " and not got.of_type("error")
    payloads = [json.loads(e.data) for e in got.events if e.data != "[DONE]"]
    assert [c["finish_reason"] for p in payloads for c in p["choices"]][-1] == "length"
    assert payloads[-1]["usage"]["completion_tokens"] == 5
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 3
    assert [block.text for block in whole.content if block.type == "text"] == ["w0 w1 w2 "]
    assert [(d.text, d.finish_reason) for d in deltas] == [
        ("w0 ", None),
        ("w1 ", None),
        ("", "length"),
    ]


async def test_cancelling_the_reader_closes_the_upstream_connection():
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/forever/v1"),)))
        stream = await engine.start(GenerationRequest("hi"))

        async def read_all() -> None:
            async for _ in stream:
                pass

        task = asyncio.ensure_future(read_all())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_for(fake.disconnected.is_set)
        await engine.aclose()


def test_engine_errors_carry_the_status_the_server_answers_with():
    assert UpstreamUnavailable("x").status == 502
    assert UpstreamTimeout("x").status == 504


async def test_temperature_and_top_p_go_upstream_only_as_the_client_gave_them():
    """An upstream applies a model's own sampling defaults (vLLM's generation config,
    Ollama's Modelfile) only to a request that leaves them out: the relay adds none."""
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/ok/v1"),), model="m"))
        async with running(create_app(engine)) as relay:
            url = f"{relay}/v1/chat/completions"
            assert (await post_events(url, CHAT)).status == 200
            given = {**CHAT, "temperature": 1.0, "top_p": 0.5}
            assert (await post_events(url, given)).status == 200
            anthropic_ask = {"model": "m", "max_tokens": 5, "messages": CHAT["messages"]}
            assert (await post_events(f"{relay}/v1/messages", anthropic_ask)).status == 200
    left_out, kept, anthropic_sent = fake.bodies
    assert "temperature" not in left_out and "top_p" not in left_out
    assert (kept["temperature"], kept["top_p"]) == (1.0, 0.5)
    assert "temperature" not in anthropic_sent and "top_p" not in anthropic_sent


async def test_top_p_0_goes_upstream_as_temperature_0_which_vllm_takes():
    """``top_p: 0`` (in OpenAI's range: keep the likeliest token) is greedy decoding; vLLM
    refuses it (its range is (0, 1]), so the relay asks for greedy as every upstream takes it:
    ``temperature: 0`` and no ``top_p``. Another ``top_p`` goes up as the client gave it."""
    async with fake_upstream() as (fake, upstream):
        vllm = f"{upstream}/vllm/v1"
        refused = await post_events(f"{vllm}/chat/completions", {**CHAT, "top_p": 0})
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(vllm),), model="m"))
        async with running(create_app(engine)) as relay:
            greedy = {**CHAT, "temperature": 0.8, "top_p": 0}
            chat = await post_events(f"{relay}/v1/chat/completions", greedy)
            asked = {"model": "m", "input": "hi", "top_p": 0, "stream": True}
            responses = await post_events(f"{relay}/v1/responses", asked)
            nucleus = {**CHAT, "temperature": 0.8, "top_p": 0.5}
            kept = await post_events(f"{relay}/v1/chat/completions", nucleus)
    assert refused.status == 400  # the stand-in refuses top_p 0 as vLLM does
    assert chat.status == responses.status == kept.status == 200
    assert chat.chat_text == "one two three "
    assert responses.of_type("response.completed")
    _, chat_sent, responses_sent, kept_sent = fake.bodies
    for sent in (chat_sent, responses_sent):
        assert sent["temperature"] == 0 and "top_p" not in sent
    assert (kept_sent["temperature"], kept_sent["top_p"]) == (0.8, 0.5)


async def test_what_the_sdk_adds_to_a_message_it_sends_back_is_not_relayed():
    """An assistant message the OpenAI SDK's stream helper assembled, sent back as history,
    carries fields the SDK adds (``annotations``, ``audio``, ``function_call``, ``parsed``;
    ``index`` and ``parsed_arguments`` on a call): taken, and the upstream gets the message
    as OpenAI documents it."""
    function = {"name": "f", "arguments": "{}"}
    call: dict[str, Any] = {"id": "call_1", "type": "function", "function": function}
    echoed = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "parsed": None,
        "tool_calls": [{**call, "index": 0, "function": {**function, "parsed_arguments": {}}}],
    }
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    messages = [{"role": "user", "content": "Hello"}, echoed, answer]
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/ok/v1"),), model="m"))
        async with running(create_app(engine)) as relay:
            got = await post_events(f"{relay}/v1/chat/completions", {**CHAT, "messages": messages})
    assert got.status == 200 and got.chat_text == "one two three "
    assert fake.bodies[0]["messages"] == [
        messages[0],
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]},
        answer,
    ]


def test_weights_share_requests_in_proportion_and_interleave():
    a, b = Backend("http://a/v1", 3), Backend("http://b/v1", 1)
    pool = UpstreamPool([a, b], BreakerConfig(), lambda: 0.0)
    picks = [pool.plan(None)[0].name[7] for _ in range(8)]
    assert picks == list("aabaaaba")
    assert UpstreamTarget.parse("http://h:1/v1=3") == UpstreamTarget("http://h:1/v1", 3)
    assert UpstreamTarget.parse("http://h:1/a=b/v1") == UpstreamTarget("http://h:1/a=b/v1", 1)
    with pytest.raises(ValueError, match="may not have a query"):  # nothing would send it
        UpstreamTarget.parse("http://h:1/v1?a=b")
    # A scheme is case-insensitive: one spelling names the upstream everywhere.
    assert UpstreamTarget.parse("HTTPS://H:1/v1/=2") == UpstreamTarget("https://H:1/v1", 2)


def test_the_prompt_goes_up_as_one_user_message_when_there_are_no_messages():
    body = request_body(
        GenerationRequest("Hello", SamplingParams(max_tokens=9, temperature=0, stop=("x",))),
        None,
    )
    assert body["messages"] == [{"role": "user", "content": "Hello"}]
    assert body["max_tokens"] == 9 and body["temperature"] == 0 and body["stop"] == ["x"]
    assert "model" not in body and "seed" not in body and "top_k" not in body
    assert "min_p" not in body  # 0, the default: the upstream's own then applies


# Words a client must never see in an error about the upstream: library and exception names,
# reprs, the socket layer's own tuples.
LIBRARY_WORDS = ("aiohttp", "Error", "Exception", "ssl:", "<", "[", "errno", "Errno", "!r")


def in_our_words(message: str) -> bool:
    return not any(word in message for word in LIBRARY_WORDS)


def error_500(content_type: bytes, page: bytes) -> bytes:
    """A whole 500 answer with ``page`` as its body, the connection closed after it."""
    head = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: %s\r\n" % content_type
    return head + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(page), page)


async def raw_upstream(answer: bytes) -> tuple[asyncio.Server, str]:
    """A TCP server that reads what comes, writes ``answer`` (maybe nothing) and hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1"


async def relay_error(base_url: str) -> tuple[int, dict[str, Any]]:
    engine = UpstreamEngine(
        UpstreamConfig((UpstreamTarget(base_url),), model="m", headers_timeout_s=2.0)
    )
    async with running(create_app(engine)) as relay:
        got = await post_events(f"{relay}/v1/chat/completions", CHAT)
    error: dict[str, Any] = json.loads(got.raw)["error"]
    return got.status, error


async def test_connection_refused_says_so_in_our_words():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    status, error = await relay_error(dead)
    assert status == 502 and error["code"] == "upstream_unavailable"
    assert error["message"] == f"cannot connect to the upstream at {dead}: connection refused"


async def test_an_upstream_that_hangs_up_before_answering_is_a_disconnect_in_our_words():
    server, base = await raw_upstream(b"")
    async with server:
        status, error = await relay_error(base)
    assert status == 502 and error["code"] == "upstream_disconnected"
    assert error["message"] == f"the upstream at {base} closed the connection before answering"


async def test_an_answer_that_is_not_http_is_named_as_such():
    server, base = await raw_upstream(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    async with server:
        status, error = await relay_error(base)
    assert status == 502 and error["code"] == "upstream_bad_response"
    assert error["message"] == f"the upstream at {base} sent a response that is not valid HTTP"


async def test_an_error_page_from_the_upstream_is_not_quoted():
    page = b"<html><body><h1>500 Internal Server Error</h1><pre>Traceback...</pre></body></html>"
    server, base = await raw_upstream(error_500(b"text/html", page))
    async with server:
        status, error = await relay_error(base)
    assert status == 502 and error["code"] == "upstream_error_status"
    assert error["message"] == f"the upstream at {base} answered 500"


async def test_a_traceback_in_an_upstreams_error_is_cut_to_its_exception():
    # A FastAPI server that puts traceback.format_exc() in its 500's message: its file paths
    # and lines of code stay with it; the exception says what failed.
    trace = (
        "Traceback (most recent call last):\n"
        '  File "/srv/venv/lib/python3.11/site-packages/llama_cpp/server/app.py", line 481, '
        "in create_chat_completion\n"
        '    raise RuntimeError("kv cache full")\n'
        "RuntimeError: kv cache full"
    )
    page = json.dumps({"error": {"message": trace, "type": "internal_server_error"}}).encode()
    server, base = await raw_upstream(error_500(b"application/json", page))
    async with server:
        status, error = await relay_error(base)
    assert status == 502 and error["code"] == "upstream_error_status"
    assert error["message"] == (
        f"the upstream at {base} answered 500: RuntimeError: kv cache full "
        "(its traceback not passed on)"
    )


async def test_tls_spoken_to_a_plain_http_upstream_is_a_tls_failure_in_our_words():
    server, base = await raw_upstream(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    async with server:
        status, error = await relay_error(base.replace("http://", "https://"))
    assert status == 502 and error["code"] == "upstream_tls"
    assert error["message"].startswith("cannot connect to the upstream at https://")
    assert "it did not answer in TLS (" in error["message"] and in_our_words(error["message"])
    assert error["message"].endswith("is it a plain HTTP port? Then its URL begins with http://")


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        # A TLS server sent plain HTTP answers with a fatal alert: a TLS record.
        (b"\x15\x03\x03\x00\x02\x02\x46", "answered in TLS: it is a TLS port"),
        # Go's HTTP servers (Caddy, Traefik) say so in plain HTTP, with a 400 the relay once
        # passed on as the client's mistake.
        (
            b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n",
            "answered 400: it is a TLS port, spoken to in plain HTTP",
        ),
    ],
)
async def test_plain_http_spoken_to_a_tls_upstream_says_its_url_must_be_https(
    answer: bytes, says: str
):
    server, base = await raw_upstream(answer)
    async with server:
        status, error = await relay_error(base)
    assert status == 502 and error["code"] == "upstream_tls", error
    assert says in error["message"] and in_our_words(error["message"]), error
    assert error["message"].endswith("its URL must begin with https://"), error


async def test_an_untrusted_certificate_is_named_in_our_words(tmp_path: Path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = await asyncio.create_subprocess_exec(
        *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"),
        *("-nodes", "-subj", "/CN=127.0.0.1", "-days", "1"),
        *("-keyout", str(key), "-out", str(cert)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert await openssl.wait() == 0
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=context)
    base = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    async with server:
        status, error = await relay_error(base)
    assert status == 502 and error["code"] == "upstream_tls"
    assert error["message"] == (
        f"cannot connect to the upstream at {base}: "
        "its TLS certificate is not trusted (self-signed certificate)"
    )


async def test_every_mid_reply_error_is_in_our_words():
    for mode in ("errmid", "stall", "malformed", "notjson", "endless", "eof"):
        got, _, _ = await relay_mode(mode)
        assert in_our_words(error_of(got)["message"]), (mode, error_of(got))


async def test_every_mid_reply_error_names_the_upstream_that_failed():
    # As failures before the stream do: the client and the log learn which upstream it was.
    for mode in ("errmid", "stall", "malformed", "notjson", "endless", "eof", "badtool"):
        got, _, _ = await relay_mode(mode)
        message = error_of(got)["message"]
        assert re.match(rf"the upstream at http://127\.0\.0\.1:\d+/{mode}/v1 ", message), message


async def test_an_upstream_that_ignores_logprobs_is_an_error_not_a_silent_omission():
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/ok/v1"),), model="m"))
        async with running(create_app(engine)) as relay:
            body = {**CHAT, "logprobs": True, "top_logprobs": 2}
            got = await post_events(f"{relay}/v1/chat/completions", body)
    assert fake.bodies[0]["logprobs"] is True and fake.bodies[0]["top_logprobs"] == 2
    assert got.chat_text == ""
    assert error_of(got)["code"] == "upstream_no_logprobs"


# Each text's log probability as an upstream may write it: only a finite number is one.
ODD_LOGPROBS = [
    ("a", "-0.5"),
    ("b", "NaN"),
    ("c", "-Infinity"),
    ("d", "1e400"),
    ("e", "-1" + "0" * 400),
    ("f", "true"),
]


async def test_a_log_probability_that_is_no_finite_number_is_skipped_and_json_stays_json():
    """JSON has no NaN or infinity: an upstream's (a Python server writes them) must not
    reach a client as such, nor end the reply; the entry is skipped, as other odd ones are."""
    async with fake_upstream() as (_, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/oddlogprobs/v1"),)))
        async with running(create_app(engine)) as relay:
            body = {**CHAT, "logprobs": True, "top_logprobs": 2}
            got = await post_events(f"{relay}/v1/chat/completions", body)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a relayed event: not JSON")

    assert got.status == 200 and got.chat_text == "abcdef" and not got.of_type("error")
    payloads = [json.loads(e.data, parse_constant=refuse) for e in got.events if e.data != "[DONE]"]
    relayed = [
        (entry["token"], entry["logprob"], [t["token"] for t in entry["top_logprobs"]])
        for p in payloads
        for c in p["choices"]
        for entry in (c.get("logprobs") or {}).get("content") or []
    ]
    assert relayed == [(word, -0.5, [word]) for word in "abcdef"]


STOPS = ["nope", "three"]  # the request's stop strings ("three": what vLLM's mode names)
ASK_CLAUDE: dict[str, Any] = {
    "model": "m",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "count"}],
    "stop_sequences": STOPS,
}


@asynccontextmanager
async def relay_of(mode: str) -> AsyncIterator[tuple[FakeUpstream, str]]:
    """A relay in front of the fake upstream's ``mode``; yields the upstream and its URL."""
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(
            UpstreamConfig((UpstreamTarget(f"{upstream}/{mode}/v1", models=("m",)),))
        )
        async with running(create_app(engine)) as relay:
            yield fake, relay


async def native_done(relay: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The native route's ``done`` event, streamed, and its body, whole, for STOPS."""
    body = {"prompt": "count", "stop": STOPS}
    got = await post_events(f"{relay}/v1/replies", {**body, "stream": True})
    assert got.text == "one two "
    [done] = got.of_type("done")
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{relay}/v1/replies", json={**body, "stream": False}) as r,
    ):
        whole = await r.json()
    assert whole["text"] == "one two "
    return done, whole


async def claude_ends(relay: str) -> list[tuple[str | None, str | None]]:
    """Anthropic's (stop_reason, stop_sequence), streamed (its ``message_delta`` and the
    SDK's final message) and whole, with the official SDK."""
    async with anthropic.AsyncAnthropic(base_url=relay, api_key="k", max_retries=0) as claude:
        async with claude.messages.stream(**ASK_CLAUDE) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
        whole = await claude.messages.create(**ASK_CLAUDE)
    [ending] = [e.delta for e in events if e.type == "message_delta"]
    assert whole.content[0].type == "text" and whole.content[0].text == "one two "
    return [
        (ending.stop_reason, ending.stop_sequence),
        (final.stop_reason, final.stop_sequence),
        (whole.stop_reason, whole.stop_sequence),
    ]


async def test_stop_strings_go_upstream_only_from_the_dialects_that_do_not_name_them():
    """Chat's and Responses' clients learn only that a stop string ended the reply: their
    upstream is sent the stop strings and cuts the text itself. Anthropic's and the native
    routes' clients learn which one, which llama.cpp, TGI and Ollama do not say: theirs is
    sent none, and the relay cuts (``test_relay_stop_strings``)."""
    async with relay_of("unnamed") as (fake, relay):
        ends = await claude_ends(relay)
        await native_done(relay)
        chat = await post_events(f"{relay}/v1/chat/completions", {**CHAT, "stop": STOPS})
        responses = await post_events(
            f"{relay}/v1/responses",
            {"model": "m", "input": "count", "stream": True, "replystream": {"stop": STOPS}},
        )
    assert [sent.get("stop") for sent in fake.bodies] == [None] * 4 + [STOPS] * 2
    assert ends == [("end_turn", None)] * 3  # no stop string in its text: the model's own end
    chunks = [json.loads(e.data) for e in chat.events if e.data != "[DONE]"]
    finishes = [c["finish_reason"] for p in chunks for c in p["choices"]]
    assert chat.chat_text == "one two " and finishes[-1] == "stop"
    assert responses.types[-1] == "response.completed"


@pytest.mark.parametrize(
    "mode",
    [
        "vllmstop",  # one of the request's stop strings (the relay sent it none)
        "sglangstop",
        "tokenstop",  # a stop token's id (EOS): the model ended its turn
        "otherstop",  # a string the client never sent
        "liststop",  # not a string at all
        "unnamed",  # no such field (llama.cpp, TGI, Ollama)
    ],
)
async def test_an_upstreams_word_for_where_it_stopped_is_never_repeated(mode: str):
    """Sent no stop strings, an upstream that finishes ``stop`` ended at the model's own
    end, whatever its finishing choice says it stopped at: nothing of it reaches a client."""
    async with relay_of(mode) as (_, relay):
        ends = await claude_ends(relay)
        done, whole = await native_done(relay)
    assert ends == [("end_turn", None)] * 3
    assert done == {"finish_reason": "stop"}
    assert whole["finish_reason"] == "stop" and "stop_sequence" not in whole


async def test_an_upstream_failure_on_the_anthropic_route_has_an_anthropic_error_type():
    """Anthropic's error types: 502 is its ``api_error``, 504 its ``timeout_error`` (OpenAI's
    ``server_error`` is none of Anthropic's), as the same failure in-band is ``api_error``."""
    ask = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    dead = f"http://127.0.0.1:{free_port()}/v1"
    async with fake_upstream() as (_, upstream):
        for url, status, kind in (
            (dead, 502, "api_error"),
            (f"{upstream}/slowhead/v1", 504, "timeout_error"),
        ):
            engine = UpstreamEngine(
                UpstreamConfig((UpstreamTarget(url, models=("m",)),), headers_timeout_s=0.3)
            )
            async with running(create_app(engine)) as relay:
                got = await post_events(f"{relay}/v1/messages", ask)
            await engine.aclose()
            body = json.loads(got.raw)
            assert got.status == status and body["type"] == "error", body
            assert body["error"]["type"] == kind, body


async def test_a_client_gone_while_its_resumable_log_is_made_closes_the_upstream(tmp_path: Path):
    """The reply's log in Redis is still being made (Redis paused, SIGSTOP) when the client
    leaves: the relayed stream started for it is closed, so the upstream learns to abort and
    the upstream counts no request still outstanding."""
    with redis_server(tmp_path / "redis") as redis:
        assert redis.process is not None
        async with fake_upstream() as (fake, upstream):
            engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/forever/v1"),)))
            store = RedisReplayStore(redis.url)
            async with running(create_app(engine, store=store)) as relay:
                ask = json.dumps({"prompt": "hi", "resumable": True, "disconnect": "cancel"})
                headers = {"Content-Type": "application/json"}
                warm = await raw_request(f"{relay}/v1/replies", "POST", ask.encode(), headers)
                await warm.aclose()  # the store is connected; that reply is cancelled
                await wait_for(lambda: engine.stats().active == 0)
                await wait_for(fake.disconnected.is_set)
                fake.disconnected.clear()
                redis.process.send_signal(signal.SIGSTOP)
                try:
                    leaving = asyncio.ensure_future(
                        raw_request(f"{relay}/v1/replies", "POST", ask.encode(), headers)
                    )
                    await wait_for(lambda: len(fake.bodies) == 2)  # its upstream answers
                    await asyncio.sleep(0.2)
                    leaving.cancel()  # closes the client's socket
                    await asyncio.gather(leaving, return_exceptions=True)
                    await asyncio.sleep(0.3)
                finally:
                    redis.process.send_signal(signal.SIGCONT)
                await wait_for(fake.disconnected.is_set)
                await wait_for(lambda: engine.stats().active == 0)
                assert engine.pool.backends[0].outstanding == 0
            await engine.aclose()
            await store.aclose()


async def test_failover_stops_within_its_limit_even_while_a_head_is_awaited():
    """Two upstreams that never answer: the second is tried while the failover window is
    open, and waited for only as long as the window has left, not a whole head timeout."""
    async with fake_upstream() as (_, one), fake_upstream() as (_, two):
        targets = tuple(UpstreamTarget(f"{u}/slowhead/v1", models=("m",)) for u in (one, two))
        engine = UpstreamEngine(UpstreamConfig(targets, headers_timeout_s=1.0, failover_s=1.2))
        async with running(create_app(engine)) as relay:
            started = time.monotonic()
            got = await post_events(f"{relay}/v1/chat/completions", {**CHAT, "model": "m"})
            took = time.monotonic() - started
        await engine.aclose()
    assert got.status == 504, got.raw
    error = json.loads(got.raw)["error"]
    # The second's wait was cut by what the window had left of its time to a first text.
    assert error["code"] == "upstream_ttft_timeout", error
    assert error["message"].endswith(
        "before the failover window (1.2 s) ended (after trying 2 upstreams)"
    )
    assert 1.2 <= took < 1.9  # two whole head timeouts would be 2 s


async def failover_from(mode: str, **config: Any) -> tuple[Any, float]:
    """One chat request through a relay in front of an upstream in ``mode`` and one that
    answers at once (tried in that order): what the client got, and how long it took."""
    async with fake_upstream() as (_, one), fake_upstream() as (_, two):
        targets = tuple(
            UpstreamTarget(f"{u}/{m}/v1", models=("m",)) for u, m in ((one, mode), (two, "ok"))
        )
        engine = UpstreamEngine(UpstreamConfig(targets, **config))
        async with running(create_app(engine)) as relay:
            started = time.monotonic()
            got = await post_events(f"{relay}/v1/chat/completions", {**CHAT, "model": "m"})
            took = time.monotonic() - started
        await engine.aclose()
    return got, took


async def test_an_upstream_slow_to_send_its_head_is_failed_over_at_the_ttft_limit():
    """An upstream that takes the connection and sends no head: the request goes on to the
    next upstream once its time to a first text is up, not after the head timeout or the
    whole failover window."""
    got, took = await failover_from("slowhead", ttft_s=0.5, headers_timeout_s=30, failover_s=8)
    assert got.status == 200 and got.chat_text == "one two three ", got.raw
    assert took < 4.0  # the window is 8 s, the head timeout 30 s


async def attempts_counted(relay: str, upstream: str) -> dict[str, float]:
    """The relay's ``replystream_upstream_attempts`` for ``upstream`` (from /metrics), by
    result, those counted at least once."""
    async with aiohttp.ClientSession() as session, session.get(f"{relay}/metrics") as response:
        text = await response.text()
    labels = rf'result="(\w+)",upstream="{re.escape(upstream)}"'
    series = re.finditer(rf"^replystream_upstream_attempts\{{{labels}\}} (\S+)$", text, re.M)
    return {match[1]: float(match[2]) for match in series if float(match[2])}


@pytest.mark.parametrize(
    ("ttft_s", "head_s", "result", "code", "said"),
    [
        # The TTFT limit, shorter, fires while the head is awaited: the limit that fired.
        (0.5, 30.0, "ttft_timeout", "upstream_ttft_timeout", "sent no text within 0.5 s"),
        # The head timeout, shorter, fires: a head that did not come.
        (30.0, 0.5, "head_timeout", "upstream_timeout", "did not answer within 0.5 s"),
    ],
)
async def test_a_head_not_sent_in_time_is_counted_as_the_limit_that_fired(
    ttft_s: float, head_s: float, result: str, code: str, said: str
):
    """An upstream that takes the request and sends no head: its attempt is counted (and the
    client told, once no upstream is left) as whichever limit ended the wait."""
    async with fake_upstream() as (_, upstream):
        base = f"{upstream}/slowhead/v1"
        targets = (UpstreamTarget(base, models=("m",)),)
        engine = UpstreamEngine(UpstreamConfig(targets, ttft_s=ttft_s, headers_timeout_s=head_s))
        async with running(create_app(engine)) as relay:
            started = time.monotonic()
            got = await post_events(f"{relay}/v1/chat/completions", {**CHAT, "model": "m"})
            took = time.monotonic() - started
            counted = await attempts_counted(relay, base)
        await engine.aclose()
    assert got.status == 504, got.raw
    error = json.loads(got.raw)["error"]
    assert error["code"] == code and said in error["message"], error
    assert counted == {result: 1.0}, counted
    assert took < 4.0  # the longer limit is 30 s


async def test_the_ttft_limit_counts_the_heads_wait_and_the_first_texts_together():
    """A head and then a first text, each within the TTFT limit but not both: the attempt's
    time to a first text is counted from its start, so the request goes on."""
    got, _ = await failover_from("latehead", ttft_s=HEAD_DELAY_S * 1.5, failover_s=8)
    assert got.status == 200 and got.chat_text == "one two three ", got.raw


class TrialUpstream(ChatUpstream):
    """One reply streams until ``release`` is set (``long``), a request fails with a 500
    (``fail``), a request waits for ``answer`` before its head (``slow``); anything else
    is answered at once. ``seen`` counts each kind."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.answer = asyncio.Event()
        self.seen: dict[str, int] = {}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        kind = (await request.json())["messages"][-1]["content"]
        self.seen[kind] = self.seen.get(kind, 0) + 1
        if kind == "fail":
            return web.json_response({"error": {"message": "broken"}}, status=500)
        if kind == "slow":
            await self.answer.wait()
        if kind != "long":
            return await reply_with(request, "fine")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk("one "))
        await self.release.wait()
        await response.write(chunk(None, "stop") + b"data: [DONE]\n\n")
        return response


async def test_a_reply_from_before_the_circuit_opened_ending_lets_no_second_trial_through():
    upstream = TrialUpstream()
    async with running(upstream.app()) as url, aiohttp.ClientSession() as session:
        config = UpstreamConfig((UpstreamTarget(f"{url}/v1"),), failures=1, cooldown_s=0.3)
        engine = UpstreamEngine(config)
        async with running(create_app(engine)) as relay:

            async def ask(kind: str, stream: bool = False) -> tuple[int, dict[str, Any] | str]:
                body = {"model": "m", "stream": stream}
                body["messages"] = [{"role": "user", "content": kind}]
                async with session.post(f"{relay}/v1/chat/completions", json=body) as response:
                    read = await response.text()
                    return response.status, read if stream else json.loads(read)

            long_reply = asyncio.create_task(ask("long", stream=True))
            await wait_for(lambda: upstream.seen.get("long") == 1)
            status, _ = await ask("fail")  # the circuit opens (one failure is enough here)
            assert status == 502
            await asyncio.sleep(0.35)  # its cool-down is over: the next request is the trial
            trial = asyncio.create_task(ask("slow"))
            await wait_for(lambda: upstream.seen.get("slow") == 1)
            upstream.release.set()  # the long reply ends well while the trial is out
            status, text = await long_reply
            assert status == 200 and "one " in text
            # The trial has no verdict yet: no other request goes to the upstream meanwhile.
            status, error = await ask("other")
            assert status == 503, error
            assert isinstance(error, dict) and error["error"]["code"] == "upstream_unavailable"
            assert "other" not in upstream.seen
            upstream.answer.set()
            status, _ = await trial
            assert status == 200
            status, _ = await ask("other")  # the trial passed: the circuit is closed
            assert status == 200
        await engine.aclose()


async def test_failover_stops_within_its_limit_while_a_refusals_body_is_read():
    """Two upstreams that answer 500 and send its body a byte at a time: the bodies are
    read only while the failover window is open, not for a head timeout each."""
    async with fake_upstream() as (_, one), fake_upstream() as (_, two):
        targets = tuple(UpstreamTarget(f"{u}/dripfail/v1", models=("m",)) for u in (one, two))
        engine = UpstreamEngine(UpstreamConfig(targets, headers_timeout_s=5.0, failover_s=1.0))
        async with running(create_app(engine)) as relay:
            started = time.monotonic()
            got = await post_events(f"{relay}/v1/chat/completions", {**CHAT, "model": "m"})
            took = time.monotonic() - started
        await engine.aclose()
    assert got.status == 502, got.raw
    error = json.loads(got.raw)["error"]
    assert error["code"] == "upstream_error_status", error
    assert took < 1.9  # the window is 1 s; one body read for a head timeout would be 5 s


async def test_a_first_text_cut_off_by_the_failover_window_says_so_in_round_numbers():
    """An upstream silent after its head, with the failover window ending before its time to
    a first text does: the error names the window, not the fraction of a second it had left."""
    async with fake_upstream() as (_, upstream):
        targets = (UpstreamTarget(f"{upstream}/slowfirst/v1", models=("m",)),)
        engine = UpstreamEngine(UpstreamConfig(targets, ttft_s=5.0, failover_s=0.5))
        async with running(create_app(engine)) as relay:
            got = await post_events(f"{relay}/v1/chat/completions", {**CHAT, "model": "m"})
        await engine.aclose()
    errors = [json.loads(e.data)["error"] for e in got.events if e.type == "error"]
    assert [e["code"] for e in errors] == ["upstream_ttft_timeout"], got.raw
    assert errors[0]["message"] == (
        f"the upstream at {upstream}/slowfirst/v1 sent no text before the failover window "
        "(0.5 s) ended"
    )


async def test_a_compressed_stream_though_none_was_asked_for_is_named_as_such():
    events = chunk("one ") + chunk(None, "stop") + b"data: [DONE]\n\n"
    body = gzip.compress(events)
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    server, base = await raw_upstream(head + body)
    async with server:
        status, error = await relay_error(base)
    assert status == 502 and error["code"] == "upstream_bad_response", error
    assert error["message"] == (
        f"the upstream at {base} answered a gzip-compressed stream, though asked for none"
    )


def test_an_upstream_errors_code_and_param_are_passed_on_only_when_name_sized():
    from replystream.engine.upstream_refusals import NAME_MAX, _upstream_message

    def said(code: str, param: str) -> tuple[str | None, str | None, str | None]:
        body = {"error": {"message": "no", "code": code, "param": param}}
        return _upstream_message(json.dumps(body).encode(), ("sk-secret",))

    assert said("context_length_exceeded", "messages") == (
        "no",
        "context_length_exceeded",
        "messages",
    )
    assert said("x" * (NAME_MAX + 1), "p" * 500) == ("no", None, None)
    assert said("bad sk-secret", "messages") == ("no", None, "messages")
