"""Delivery policies on the OpenAI routes: resume across cuts, batching, cancel, ownership."""

import asyncio
import json
import random
from urllib.parse import urlsplit

import aiohttp

from replystream.client import ResumingReader
from replystream.client.resume import Backoff
from replystream.server import create_app, running
from replystream.sse import EventParser
from tests.chaos_proxy import chaos_proxy, random_budget
from tests.conftest import fast_engine, wait_for

USER = [{"role": "user", "content": "hi"}]
FAST_RETRY = Backoff(base_s=0.005, cap_s=0.05, max_attempts=50)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port
    return parts.hostname, parts.port


def chunk_text(data: str) -> str:
    chunk = json.loads(data)
    return "".join(c["delta"].get("content", "") for c in chunk["choices"])


async def test_a_resumable_chat_stream_survives_cuts_without_gap_or_duplicate():
    engine = fast_engine(delay_ms=2, jitter_ms=1)
    body = {"messages": USER, "seed": 4, "stream": True, "resumable": True}
    async with running(create_app(engine)) as url:
        async with aiohttp.ClientSession() as http:
            whole = {**body, "stream": False, "resumable": None}
            async with http.post(f"{url}/v1/chat/completions", json=whole) as response:
                expected = (await response.json())["choices"][0]["message"]["content"]
        rng = random.Random(3)
        async with chaos_proxy(lambda: host_port(url), random_budget(rng, 600, 3000)) as (
            proxied,
            proxy,
        ):
            for n in range(5):
                reader = ResumingReader(
                    f"{proxied}/v1/chat/completions", json_body=body, backoff=FAST_RETRY, seed=n
                )
                data = [event.data async for event in reader.events()]
                assert data[-1] == "[DONE]"
                assert "".join(chunk_text(d) for d in data[:-1]) == expected
        assert proxy.cuts >= 5


async def test_batching_sends_fewer_chunks_with_the_same_text():
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        texts, counts = [], []
        for batch in (1, 8):
            body = {"messages": USER, "stream": True, "max_tokens": 32, "batch_tokens": batch}
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                lines = [ln for ln in (await response.text()).split("\n") if ln.startswith("data:")]
            payloads = [ln.removeprefix("data: ") for ln in lines[:-1]]
            texts.append("".join(chunk_text(p) for p in payloads))
            counts.append(len(payloads))
    assert texts[0] == texts[1]
    assert counts == [1 + 32 + 1, 1 + 4 + 1]  # role, text chunks, finish


async def test_cancel_endpoint_stops_an_openai_stream_with_an_in_band_error():
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        body = {"messages": USER, "stream": True}
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            reply_id = response.headers["X-Reply-Id"]
            await response.content.readuntil(b"\n\n")
            async with http.post(f"{url}/v1/replies/{reply_id}/cancel") as cancel:
                assert cancel.status == 200
            raw = await response.text()
    last = EventParser().feed(raw.encode())[-1]
    assert "[DONE]" not in raw and last.type == "error"
    assert json.loads(last.data)["error"]["code"] == "cancelled"
    await wait_for(lambda: engine.stats().cancelled == 1)


async def test_a_client_that_leaves_stops_generation():
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        body = {"prompt": "x", "stream": True, "max_tokens": 100}
        async with http.post(f"{url}/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            await response.content.readuntil(b"\n\n")
        await wait_for(lambda: engine.stats().cancelled == 1)
    assert engine.stats().steps < 100


async def test_a_client_that_half_closes_is_one_that_left():
    # The end of a socket's input is the only sign a closed tab gives before the next write
    # (docs/reliability.md): a half-close is taken for it, so generation stops.
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 100}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    async with running(create_app(engine)) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head.encode() + body)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 10)  # the server closes its side
        writer.close()
        await wait_for(lambda: engine.stats().cancelled == 1)
    assert engine.stats().steps < 100


async def test_every_buffered_route_feeds_the_time_between_tokens_histogram():
    # The buffered routes share one glue (server/context.py); each reply of n tokens adds
    # n - 1 gaps to its endpoint's histogram, whichever route it came through.
    engine = fast_engine(delay_ms=2.0, jitter_ms=0.0)
    chat = {"model": engine.name, "messages": [{"role": "user", "content": "x"}]}
    asks = {
        "/v1/chat/completions": {**chat, "max_tokens": 5},
        "/v1/completions": {"model": engine.name, "prompt": "x", "max_tokens": 5},
        "/v1/replies": {"prompt": "x", "max_tokens": 5, "stream": False},
    }
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        for path, body in asks.items():
            async with http.post(f"{url}{path}", json=body) as response:
                assert response.status == 200, await response.text()
        async with http.get(f"{url}/wait?max_tokens=5") as response:
            assert response.status == 200
        async with http.get(f"{url}/metrics") as response:
            metrics = await response.text()
    for path in [*asks, "/wait"]:
        line = f'replystream_time_between_tokens_seconds_count{{endpoint="{path}"}}'
        counts = [float(row.split()[-1]) for row in metrics.splitlines() if row.startswith(line)]
        assert counts == [4.0], (path, counts)


async def test_every_event_a_stream_sends_is_counted_its_ending_included():
    # A reply's last events (the finish, the usage, [DONE]; usage and done) and any backlog
    # are sent by its readers after the reply itself was accounted for.
    engine = fast_engine(delay_ms=2.0, jitter_ms=0.0)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}
    asks = {
        "/v1/chat/completions": {**chat, "stream_options": {"include_usage": True}},
        "/v1/replies": {"prompt": "x", "max_tokens": 5},
        "/v1/messages": {**chat, "model": engine.name},
    }
    # Answered whole, the one body is the events: a stored response's was once not counted.
    whole = {"/v1/responses": {"input": "x", "max_output_tokens": 5}}
    read: dict[str, bytes] = {}
    # The bytes as they came (aiohttp's client asks for gzip: the whole body comes gzipped).
    session = aiohttp.ClientSession(auto_decompress=False)
    async with running(create_app(engine)) as url, session as http:
        for path, body in [*asks.items(), *whole.items()]:
            async with http.post(f"{url}{path}", json=body) as response:
                read[path] = await response.read()
        plain = {"Accept-Encoding": "identity"}
        async with http.get(f"{url}/metrics", headers=plain) as response:
            metrics = await response.text()

    def counted(name: str, path: str) -> float:
        line = f'replystream_{name}_total{{endpoint="{path}"}} '
        return float(next(r for r in metrics.splitlines() if r.startswith(line)).split()[-1])

    for path, got in read.items():
        events = 1 if path in whole else got.count(b"\n\n")
        assert counted("events_sent", path) == events, path
        # The body's bytes, whichever way each write went (the chunk framing is not body).
        assert counted("bytes_sent", path) == len(got), path


async def test_a_reader_of_a_reply_not_made_for_it_counts_what_it_sends_under_its_route():
    # A resume of a reply that had ended (or one made on another replica) has no producer's
    # record here: what it sent was counted nowhere.
    engine = fast_engine(delay_ms=1.0, jitter_ms=0.0)
    ask = {"prompt": "x", "max_tokens": 5, "resumable": True}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/replies", json=ask) as response:
            reply_id = response.headers["X-Reply-Id"]
            await response.read()
        async with http.get(f"{url}/v1/replies/{reply_id}/stream") as response:
            again = await response.read()
        async with http.get(f"{url}/metrics") as response:
            metrics = await response.text()
    route = "/v1/replies/{reply_id}/stream"
    counted = {
        name: float(
            next(
                row
                for row in metrics.splitlines()
                if row.startswith(f'replystream_{name}_total{{endpoint="{route}"}} ')
            ).split()[-1]
        )
        for name in ("events_sent", "bytes_sent")
    }
    assert counted == {"events_sent": again.count(b"\n\n"), "bytes_sent": len(again)}
