"""Delivery policies through the real server on loopback: moderation, batching, keep-alive,
slow clients, compression, cancellation and metrics."""

import asyncio
import gzip
import json
import re
import socket
import time
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from replystream.delivery.moderation import BannedPhrases, RegexCheck, secret_check
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine import SimulatedEngine
from replystream.engine.base import Delta, DeltaStream, GenerationRequest
from replystream.engine.reply_script import parse_reply_script
from replystream.engine.simulated import SimulatedConfig, simulated_engine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, wait_for
from tests.processes import launch, ready_url, replica, stop
from tests.rawhttp import RawResponse, raw_request
from tests.scripted_engine import ScriptedEngine
from tests.sse_client import Received, post_events
from tests.stalling_proxy import small_send_buffer

REPLY = "we will now launch the rocket at dawn and then we go home to rest"


def steps_reached(engine: SimulatedEngine, target: int) -> bool:
    return engine.stats().steps >= target


async def stalled_post(url: str, body: bytes) -> RawResponse:
    """A POST on a socket with a small receive buffer, its head read: the caller then reads
    nothing for as long as it likes."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    # Its own buffer small too (a stream reader's default takes in 128 KiB before it stops).
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)
    response = RawResponse(reader, writer)
    await response.read_head()
    assert response.status == 200
    return response


def serve(engine: SimulatedEngine, **policy: object):
    return running(create_app(engine, ServerConfig(policy=DeliveryPolicy(**policy))))  # type: ignore[arg-type]


@pytest.mark.parametrize("batch_tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("holdback", [0, 1, 2, 3, 6])
@pytest.mark.parametrize("phrase", ["the rocket at", "unch the ro"])
async def test_banned_phrase_across_tokens_and_batches_is_never_sent(
    batch_tokens: int, holdback: int, phrase: str
):
    engine = fast_engine(reply_text=REPLY, delay_ms=2, jitter_ms=0)
    async with serve(engine, checks=(BannedPhrases([phrase.upper()]),)) as url:
        got = await post_events(
            f"{url}/v1/replies",
            {"prompt": "x", "batch_tokens": batch_tokens, "holdback_tokens": holdback},
        )
        await wait_for(lambda: engine.stats().active == 0)
    sent = got.text
    assert phrase not in sent
    assert got.types[-1] == "moderated" and "done" not in got.types
    moderated = got.of_type("moderated")[0]
    assert moderated["released_chars"] == len(sent)
    assert moderated["check"] == "banned_phrase"
    assert REPLY.startswith(sent)
    assert engine.stats().cancelled == 1  # generation stopped with the reply
    # With a window at least as long as the phrase, no part of it leaves.
    if holdback >= 3:
        assert sent == REPLY[: REPLY.index(phrase)]


async def test_buffered_reply_never_contains_any_part_of_a_phrase_across_tokens():
    engine = fast_engine(reply_text=REPLY)
    async with serve(engine, checks=(BannedPhrases(["rocket at dawn"]),)) as url:
        response = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt": "x", "stream": false}'
        )
        body = json.loads(await response.read_body())
    assert body["text"] == "we will now launch the "
    assert body["finish_reason"] == "moderated"


# Prose with a word a credential pattern would match from its middle on ("sk-" of "task-"),
# or a word-bounded pattern from its middle ("ass" of "class"), then enough text that the
# released tail a check reads again is cut at every character, that one included.
HYPHENATED = (
    "Use the task-management-system-for-teams in class today. "
    + "Then write it all down, and keep writing for a good while longer. " * 5
)


@pytest.mark.parametrize("route", ["/v1/replies", "/v1/chat/completions"])
async def test_a_check_reads_a_word_boundary_where_the_released_tail_is_cut(route: str):
    engine = ScriptedEngine(list(HYPHENATED))  # a character a token: every cut is tried
    checks = (secret_check(), RegexCheck({"word": r"\bass\b"}))
    ask = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "model": "scripted"}
    ask = {k: v for k, v in ask.items() if (k == "prompt") == (route == "/v1/replies")}
    policy = DeliveryPolicy(holdback_tokens=2, checks=checks)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        streamed = await post_events(f"{url}{route}", {**ask, "stream": True})
        response = await raw_request(
            f"{url}{route}", "POST", json.dumps({**ask, "stream": False}).encode()
        )
        whole = json.loads(await response.read_body())
    # Nothing here is a credential or the word: the stream and the whole reply say it all.
    if route == "/v1/replies":
        assert streamed.text == HYPHENATED and streamed.types[-1] == "done"
        assert whole["text"] == HYPHENATED and whole["finish_reason"] == "stop"
    else:
        assert streamed.chat_text == HYPHENATED and b"content_filter" not in streamed.raw
        assert whole["choices"][0]["message"]["content"] == HYPHENATED


async def test_buffered_reply_is_checked_too():
    engine = fast_engine(reply_text=REPLY)
    async with serve(engine, checks=(BannedPhrases(["rocket"]),)) as url:
        response = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt": "x", "stream": false}'
        )
        body = await response.read_body()
    assert b"rocket" not in body
    assert b'"finish_reason":"moderated"' in body


@pytest.mark.parametrize("store", [False, True])
async def test_a_whole_response_keeps_no_part_of_a_phrase_stored_or_not(store: bool):
    """A Responses request answered in one body is checked whole whether it is stored or
    not: storing it must not turn the check into the streaming window's, which would keep
    the phrase's start in the stored response (and in what GET returns)."""
    engine = fast_engine(reply_text=REPLY)
    async with serve(engine, checks=(BannedPhrases(["rocket at dawn"]),)) as url:
        body = {"input": "x", "store": store}
        response = await raw_request(f"{url}/v1/responses", "POST", json.dumps(body).encode())
        whole = json.loads(await response.read_body())
        kept = None
        if store:
            got = await raw_request(f"{url}/v1/responses/{whole['id']}", "GET", b"")
            kept = json.loads(await got.read_body())
    assert whole["incomplete_details"]["reason"] == "content_filter"
    assert whole["output"][0]["content"][0]["text"] == "we will now launch the "
    if kept is not None:
        assert kept["output"] == whole["output"]


COUNTED = "one two three four five six seven eight nine ten"  # a token a word
USER = [{"role": "user", "content": "Hi"}]
Counts = tuple[int, int]  # a reply's usage: prompt tokens, completion tokens (streamed; whole)


def chat_usage(got: Received, body: dict[str, Any]) -> tuple[Counts, Counts]:
    chunks = [json.loads(e.data) for e in got.events if e.data.startswith("{")]
    streamed = [c["usage"] for c in chunks if not c["choices"]]
    assert len(streamed) == 1, chunks[-2:]  # one usage chunk, as every other ending sends
    return (streamed[0]["prompt_tokens"], streamed[0]["completion_tokens"]), (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )


def native_usage(got: Received, body: dict[str, Any]) -> tuple[Counts, Counts]:
    assert got.types[-2:] == ["usage", "moderated"]
    streamed = got.of_type("usage")[0]
    assert body["finish_reason"] == "moderated"
    return (streamed["prompt_tokens"], streamed["completion_tokens"]), (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )


def responses_usage(got: Received, body: dict[str, Any]) -> tuple[Counts, Counts]:
    usage = got.of_type("response.incomplete")[0]["response"]["usage"]
    assert body["incomplete_details"]["reason"] == "content_filter"
    return (usage["input_tokens"], usage["output_tokens"]), (
        body["usage"]["input_tokens"],
        body["usage"]["output_tokens"],
    )


def anthropic_usage(got: Received, body: dict[str, Any]) -> tuple[Counts, Counts]:
    end = got.of_type("message_delta")[0]
    assert end["delta"]["stop_reason"] == body["stop_reason"] == "refusal"
    return (end["usage"]["input_tokens"], end["usage"]["output_tokens"]), (
        body["usage"]["input_tokens"],
        body["usage"]["output_tokens"],
    )


CHAT_ASK = {"messages": USER, "max_tokens": 20}
MODERATED_ROUTES = [
    ("/v1/replies", {"prompt": "Hi", "max_tokens": 20}, {}, native_usage, 1),
    ("/v1/chat/completions", CHAT_ASK, {"stream_options": {"include_usage": True}}, chat_usage, 1),
    (
        "/v1/chat/completions",
        {**CHAT_ASK, "n": 2},
        {"stream_options": {"include_usage": True}},
        chat_usage,
        2,
    ),
    (
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 20},
        {"stream_options": {"include_usage": True}},
        chat_usage,
        1,
    ),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 20}, {}, responses_usage, 1),
    ("/v1/messages", {"model": "simulated", **CHAT_ASK}, {}, anthropic_usage, 1),
]


@pytest.mark.parametrize(("route", "ask", "streamed", "usage_of", "n"), MODERATED_ROUTES)
async def test_a_moderated_replys_usage_counts_the_tokens_made_streamed_or_whole(
    route, ask, streamed, usage_of, n
):
    engine = fast_engine(reply_text=COUNTED, delay_ms=2, jitter_ms=0)
    async with serve(engine, holdback_tokens=3, checks=(BannedPhrases(["five six"]),)) as url:
        got = await post_events(f"{url}{route}", {**ask, **streamed, "stream": True})
        response = await raw_request(
            f"{url}{route}", "POST", json.dumps({**ask, "stream": False}).encode()
        )
        body = json.loads(await response.read_body())
    stream_usage, whole_usage = usage_of(got, body)
    # The tokens made up to the one that completed the match (six), held ones included, as a
    # stop string's are; none after it. Per choice, summed; the prompt counted once.
    assert stream_usage == whole_usage
    assert stream_usage[1] == 6 * n and stream_usage[0] > 0


async def test_batches_carry_k_tokens_and_lose_or_repeat_nothing():
    engine = fast_engine(delay_ms=1, jitter_ms=0)
    async with serve(engine) as url:
        one = await post_events(f"{url}/v1/replies", {"prompt": "x", "max_tokens": 23})
        three = await post_events(
            f"{url}/v1/replies", {"prompt": "x", "max_tokens": 23, "batch_tokens": 3}
        )
    counts = [t["tokens"] for t in three.of_type("token")]
    assert counts == [3] * 7 + [2]
    assert three.text == one.text
    assert len(one.of_type("token")) == 23


async def test_a_time_window_flushes_a_partial_batch_while_tokens_are_slow():
    engine = fast_engine(delay_ms=40, jitter_ms=0)
    async with serve(engine) as url:
        got = await post_events(
            f"{url}/v1/replies",
            {"prompt": "x", "max_tokens": 6, "batch_tokens": 100, "batch_ms": 10},
        )
    # Each token waits at most the 10 ms window, so no batch gathers two 40 ms tokens.
    assert [t["tokens"] for t in got.of_type("token")] == [1] * 6


@pytest.mark.parametrize(
    ("server", "asked", "batched"),
    [
        (DeliveryPolicy(), {"batch_ms": 100}, True),  # the request's window alone
        (DeliveryPolicy(batch_ms=100), {}, True),  # the server's window alone
        (DeliveryPolicy(batch_ms=100), {"batch_tokens": 1}, False),  # one token, said so
        (DeliveryPolicy(batch_tokens=1), {"batch_ms": 100}, False),  # the server's one token
    ],
    ids=["request-window", "server-window", "request-one-token", "server-one-token"],
)
async def test_a_time_window_alone_batches_by_time(
    server: DeliveryPolicy, asked: dict[str, int], batched: bool
):
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    app = create_app(engine, ServerConfig(policy=server))
    async with running(app) as url:
        got = await post_events(f"{url}/v1/replies", {"prompt": "x", "max_tokens": 20, **asked})
    counts = [t["tokens"] for t in got.of_type("token")]
    assert sum(counts) == 20
    if batched:  # tokens 10 ms apart, gathered for 100 ms: a few events, not twenty
        assert len(counts) <= 10, counts
    else:
        assert counts == [1] * 20


class PacedChoices(ScriptedEngine):
    """Two choices (seeds 7 and 8): each says a word, choice 1 30 ms after choice 0, then
    nothing for 1 s, then its last word."""

    async def start(self, request: GenerationRequest) -> DeltaStream:
        choice = (request.sampling.seed or 7) - 7
        return self._paced(f"c{choice} ", 0.03 * choice)

    async def _paced(self, word: str, first_s: float) -> AsyncGenerator[Delta, None]:
        await asyncio.sleep(first_s)
        yield Delta(word, 1, time.monotonic())
        await asyncio.sleep(1.0)
        yield Delta("end", 1, time.monotonic(), "stop")


async def test_a_time_window_is_kept_for_every_choice_of_several():
    """Both choices' first words wait in their batches at once: each leaves within the
    window (100 ms), not when a choice next makes a token. One timer, for the batch due
    first, used to be all there was: choice 1's word waited a whole second."""
    app = create_app(PacedChoices(), ServerConfig(policy=DeliveryPolicy()))
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "n": 2,
        "seed": 7,
        "batch_tokens": 100,
        "batch_ms": 100,
    }
    arrived: dict[str, float] = {}
    async with running(app) as url, aiohttp.ClientSession() as session:
        sent = time.monotonic()
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text = choice["delta"].get("content")
                        if text:
                            arrived.setdefault(text, time.monotonic() - sent)
    assert set(arrived) == {"c0 ", "c1 ", "end"}, arrived
    assert arrived["c1 "] < 0.6 < arrived["end"], arrived


async def test_keep_alive_comment_arrives_during_a_long_wait_for_the_first_token():
    engine = fast_engine(first_token_ms=2000, delay_ms=5)
    async with serve(engine, keepalive_s=0.5) as url:
        response = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt": "x", "max_tokens": 2}'
        )
        body = await response.read_body()
    assert response.status == 200
    first_event = body.index(b"event: token")
    assert body.count(b": keep-alive", 0, first_event) >= 2


async def test_waiting_readers_get_keep_alives_each_at_its_own_period():
    # One clock serves every waiting reader; each still gets keep-alives at its own rate.
    engine = fast_engine(first_token_ms=2500, delay_ms=5)
    async with serve(engine, keepalive_s=30) as url:

        async def stream(keepalive_s: float) -> bytes:
            body = json.dumps({"prompt": "x", "max_tokens": 1, "keepalive_s": keepalive_s})
            response = await raw_request(f"{url}/v1/replies", "POST", body.encode())
            return await response.read_body()

        often, seldom = await asyncio.gather(stream(0.2), stream(1.0))
    before_token = [body[: body.index(b"event: token")] for body in (often, seldom)]
    counts = [part.count(b": keep-alive") for part in before_token]
    # 2.5 s of waiting: about 10 and 2 (a sweep may be a quarter period late). The bounds
    # leave room for a slow machine; woken at the shorter period, both would get about 10.
    assert counts[0] >= 5 and 1 <= counts[1] <= 5 and counts[0] >= 2 * counts[1], counts


async def test_event_streams_are_never_compressed_and_json_is():
    engine = fast_engine(delay_ms=1, jitter_ms=0)
    async with serve(engine) as url:
        gz = {"Accept-Encoding": "gzip"}
        stream = await raw_request(f"{url}/stream", headers=gz)
        stream_body = await stream.read_body()
        wait = await raw_request(f"{url}/wait", headers=gz)
        wait_body = await wait.read_body()
    assert "content-encoding" not in stream.headers
    assert stream_body.endswith(b"data: [DONE]\n\n")
    assert wait.headers["content-encoding"] == "gzip"
    assert gzip.decompress(wait_body).startswith(b'{"text":"A language model')


async def test_a_client_that_stops_reading_is_cut_and_its_generation_cancelled():
    # Big fast tokens (3,000 of 4 KB), a reader that never reads: the socket stops draining.
    engine = fast_engine(reply_text=" ".join(["y" * 4000] * 3000), delay_ms=0.2, jitter_ms=0.1)
    async with serve(engine, slow_client_s=1.0, slow_client_bytes=256 << 10) as url:
        response = await raw_request(f"{url}/v1/replies", "POST", b'{"prompt": "x"}')
        await wait_for(lambda: engine.stats().active == 0, timeout_s=20)
        assert engine.stats().cancelled == 1
        assert engine.stats().steps < 3000
        tail = await response.read_body()  # now read what the server left for us
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    assert tail.rstrip().endswith(b"}")
    assert b"event: error" in tail[-300:] and b"slow_client" in tail[-300:]
    assert re.search(
        rb'replystream_replies_total\{endpoint="/v1/replies",outcome="slow_client"\} 1', metrics
    )


@pytest.mark.parametrize(
    ("route", "ask"),
    [
        ("/v1/replies", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
    ],
)
async def test_a_reader_whose_socket_stopped_draining_is_cut_within_the_time_limit(route, ask):
    # 120 KB of events at once, then the reply pauses for 4 s: a reader that reads nothing
    # fills its sockets' and its own few KB and the server's 64 KiB write buffer past its
    # high-water mark, so the server's next write waits for a socket that does not drain,
    # and is cut 0.5 s later, in the pause. The server's writes once went on without
    # waiting until another 64 KiB had been written since the buffer last drained (aiohttp
    # waits only then): this reader was not cut, and its reply was made to its end for
    # nobody (then sent whole, its end queued before the cut).
    steps: list[dict[str, object]] = [{"text": "y" * 999 + " ", "delay_ms": 0.5}] * 120
    steps.append({"text": "end", "delay_ms": 4000})
    engine = simulated_engine(SimulatedConfig(script=parse_reply_script(steps)))
    app = create_app(engine, ServerConfig(policy=DeliveryPolicy(slow_client_s=0.5)))
    app.on_response_prepare.append(small_send_buffer)
    async with running(app) as url:
        stalled = await stalled_post(f"{url}{route}", json.dumps(ask).encode())
        await wait_for(lambda: engine.stats().active == 0, timeout_s=3)
        assert engine.stats().cancelled == 1
        body = await stalled.read_body()  # now read what the server left for us
    assert b"slow_client" in body[-300:] and b'"end"' not in body


@pytest.mark.parametrize(
    ("route", "ask"),
    [
        ("/v1/replies", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
    ],
)
async def test_a_reader_cut_as_slow_is_counted_sent_every_byte_it_then_reads(route, ask):
    """What a cut reader reads after its cut (the write that was waiting for its socket, then
    the ``slow_client`` event) was handed to its socket: the events and bytes counters hold
    every event and byte it read, as they do for a reader that was not cut."""
    engine = fast_engine(reply_text=" ".join(["y" * 4000] * 3000), delay_ms=0.2, jitter_ms=0.1)
    async with serve(engine, slow_client_s=1.0, slow_client_bytes=256 << 10) as url:
        response = await raw_request(f"{url}{route}", "POST", json.dumps(ask).encode())
        await wait_for(lambda: engine.stats().active == 0, timeout_s=20)
        body = await response.read_body()  # now read everything the server left for us
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    assert b"slow_client" in body[-300:]

    def sent(series: str) -> float:
        found = re.search(
            rb'replystream_%s_total\{endpoint="%s"\} (\S+)' % (series.encode(), route.encode()),
            metrics,
        )
        assert found, series
        return float(found.group(1))

    assert (sent("bytes_sent"), sent("events_sent")) == (len(body), body.count(b"\n\n"))


async def test_client_leaving_cancels_in_both_native_modes_and_metrics_say_so():
    engine = fast_engine(delay_ms=10, jitter_ms=0)
    async with serve(engine) as url:
        for stream in (b"true", b"false"):
            task = asyncio.create_task(
                raw_request(f"{url}/v1/replies", "POST", b'{"prompt":"x","stream":%s}' % stream)
            )
            target = engine.stats().steps + 3
            await wait_for(partial(steps_reached, engine, target))
            if stream == b"true":
                response = await task
                await response.aclose()
            else:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_for(lambda: engine.stats().active == 0)
        metrics = await (await raw_request(f"{url}/metrics")).read_body()
    assert engine.stats().cancelled == 2 and engine.stats().finished == 0
    assert re.search(
        rb'replystream_replies_total\{endpoint="/v1/replies",outcome="cancelled"\} 2', metrics
    )


@pytest.mark.parametrize(
    ("route", "ask"), [(route, ask) for route, ask, *_ in MODERATED_ROUTES], ids=str
)
async def test_a_request_may_widen_the_servers_holdback_window_but_not_narrow_it(route, ask):
    # The Responses and Messages APIs take replystream's own fields under ``replystream``.
    under = "replystream." if route in ("/v1/responses", "/v1/messages") else ""

    def extension(tokens: int) -> dict[str, object]:
        if under:
            return {"replystream": {"holdback_tokens": tokens}}
        return {"holdback_tokens": tokens}

    engine = fast_engine(reply_text=COUNTED, delay_ms=2, jitter_ms=0)
    async with serve(engine, holdback_tokens=3, checks=(BannedPhrases(["five six"]),)) as url:
        narrowed = await raw_request(
            f"{url}{route}", "POST", json.dumps({**ask, **extension(1)}).encode()
        )
        refusal = json.loads(await narrowed.read_body())["error"]
        widened = await post_events(f"{url}{route}", {**ask, **extension(5)})
    assert narrowed.status == 400
    assert refusal["param"] == f"{under}holdback_tokens"
    assert "holdback_tokens is 1" in refusal["message"]
    assert "at least 3 tokens" in refusal["message"]
    assert "six" not in widened.text and "five" not in widened.text


async def test_no_alternative_a_check_matches_reaches_the_reader_in_top_logprobs():
    # The simulated engine's alternatives are its reply's other words, the banned ones among
    # them, though the reply stops before them: the model weighed them, no reader sees them.
    engine = fast_engine(reply_text="we leave at dawn with the FORBIDDEN cargo")
    checks = (BannedPhrases(["forbidden"]), RegexCheck({"cargo": r"\bcargo\b"}))
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    asks = {
        "/v1/chat/completions": {**chat, "logprobs": True, "top_logprobs": 8},
        "/v1/completions": {"prompt": "x", "max_tokens": 4, "logprobs": 5},
    }
    async with serve(engine, checks=checks) as url, aiohttp.ClientSession() as http:
        for path, body in asks.items():
            bodies = []
            async with http.post(f"{url}{path}", json=body) as response:
                bodies.append(await response.text())
            streamed = await post_events(f"{url}{path}", {**body, "stream": True})
            bodies.append(streamed.raw.decode())
            for text in bodies:
                # The other alternatives are there: "with" comes after the four words made,
                # so it is in the text only as an alternative.
                assert "with" in text, path
                assert "FORBIDDEN" not in text and "cargo" not in text, (path, text)


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--block-secrets"], True),
        (["--ban", "rocket"], True),
        (["--ban", "rocket", "--holdback-tokens", "4"], False),
        ([], False),
    ],
)
async def test_checks_without_a_window_are_said_to_let_a_phrases_start_out(
    flags: list[str], warned: bool
):
    # With no window, a key of many tokens is stopped at its last: the rest is already sent.
    process = await launch("--engine", "simulated", *flags, stderr=asyncio.subprocess.PIPE)
    try:
        await ready_url(process)
    finally:
        await stop(process)
    assert process.stderr is not None
    said = (await process.stderr.read()).decode()
    assert ("--holdback-tokens 0" in said) is warned, said


@pytest.mark.parametrize(
    ("banned", "written"),
    [
        ("café", "cafe\u0301"),  # the accent a combining mark after the letter
        ("cafe\u0301", "café"),  # the phrase given so, the text composed
        ("세계", "\u1109\u1166\u1100\u1168"),  # Hangul syllables written as their letters (jamo)
    ],
)
async def test_a_banned_phrase_is_found_in_its_composed_or_decomposed_form(
    banned: str, written: str
):
    # NFKC makes "e" + U+0301 the one "é", and conjoining jamo their syllable: folding each
    # character alone left them apart, and the phrase got past the check either way round.
    reply = f"we drink {written} then rest"
    async with replica(
        "--engine", "simulated", "--delay-ms", "1", "--reply-text", reply, "--ban", banned
    ) as (_, url):
        streamed = await post_events(f"{url}/v1/replies", {"prompt": "x"})
        async with aiohttp.ClientSession() as http:
            whole_url = f"{url}/v1/chat/completions"
            chat = {"messages": [{"role": "user", "content": "x"}]}
            async with http.post(whole_url, json=chat) as response:
                whole = await response.json()
    assert streamed.text == "we drink " and streamed.types[-1] == "moderated"
    assert whole["choices"][0]["message"]["content"] == "we drink "
    assert whole["choices"][0]["finish_reason"] == "content_filter"


@pytest.mark.parametrize("window", [1, 2])
async def test_a_moderated_reply_counts_as_released_only_the_tokens_it_sent(window: int):
    # Byte-level tokens: each character of the phrase "ニュー" takes two, its first ending
    # inside the character. A window shorter than that let such a first token out alone,
    # counted as released though its character never was.
    engine = ScriptedEngine()
    engine.say_bytes(
        [b"\xe3\x82", b"\xa2", b"\xe3\x83", b"\x8b", b"\xe3\x83", b"\xa5", b"\xe3\x83", b"\xbc"]
    )
    policy = DeliveryPolicy(checks=(BannedPhrases(["ニュー"]),), holdback_tokens=window)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        got = await post_events(f"{url}/v1/replies", {"prompt": "x"})
    sent = sum(event["tokens"] for event in got.of_type("token"))
    moderated = got.of_type("moderated")[0]
    assert moderated["released_chars"] == len(got.text) and "アニュ".startswith(got.text)
    assert moderated["released_tokens"] == sent == 2 * len(got.text)
