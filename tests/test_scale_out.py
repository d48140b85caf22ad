"""Replicas sharing one Redis, behind a real nginx: resume anywhere, fail loudly.

Everything runs on loopback: a redis-server, two ``replystream serve`` processes and an
nginx (round-robin upstream, buffering off), all started by the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from replystream.client import ResumingReader
from replystream.client.resume import Backoff
from replystream.delivery.redis_store import RedisReplayStore
from replystream.engine.simulated import SimulatedEngine
from replystream.server import create_app, running
from replystream.server.context import MANAGER_KEY
from replystream.server.server_config import ServerConfig
from tests.chaos_proxy import chaos_proxy, random_budget
from tests.conftest import fast_engine, wait_for
from tests.nginx import running_nginx
from tests.processes import replica, start_server, stop
from tests.rawhttp import raw_request
from tests.redis_server import RedisServer, redis_server
from tests.services import free_port
from tests.sse_client import post_events

FAST_RETRY = Backoff(base_s=0.01, cap_s=0.1, max_attempts=60)
REPLICA_ARGS = ("--engine", "simulated", "--delay-ms", "4", "--jitter-ms", "1", "--tokens", "150")


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port
    return parts.hostname, parts.port


def upstream_config(port: int, replicas: list[str]) -> str:
    servers = "\n".join(f"        server {urlsplit(u).netloc};" for u in replicas)
    return f"""    upstream replicas {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://replicas;
            proxy_buffering off;
            proxy_read_timeout 60s;
            add_header X-Upstream $upstream_addr always;
        }}
    }}"""


@dataclass
class Cluster:
    redis: RedisServer
    replicas: list[str]
    processes: list[asyncio.subprocess.Process]
    nginx: str


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, *extra: str) -> AsyncIterator[Cluster]:
    with redis_server(tmp_path / "redis") as redis:
        async with (
            replica(*REPLICA_ARGS, "--redis-url", redis.url, *extra) as (a_proc, a_url),
            replica(*REPLICA_ARGS, "--redis-url", redis.url, *extra) as (b_proc, b_url),
        ):
            port = free_port()
            config = upstream_config(port, [a_url, b_url])
            async with running_nginx(config, port, tmp_path / "nginx") as nginx:
                yield Cluster(redis, [a_url, b_url], [a_proc, b_proc], nginx)


async def reply_text(reader: ResumingReader) -> str:
    parts = [json.loads(e.data)["text"] async for e in reader.events() if e.type == "token"]
    return "".join(parts)


async def test_100_disconnects_resumed_across_two_replicas_behind_nginx(tmp_path: Path):
    rng = random.Random(11)
    async with cluster(tmp_path) as c:
        expected = (await post_events(f"{c.replicas[0]}/v1/replies", {"prompt": "x"})).text
        async with chaos_proxy(lambda: host_port(c.nginx), random_budget(rng, 300, 1500)) as (
            proxied,
            proxy,
        ):
            replies = 0
            while proxy.cuts < 100:
                reader = ResumingReader(
                    f"{proxied}/v1/replies",
                    json_body={"prompt": "x", "resumable": True},
                    backoff=FAST_RETRY,
                    seed=replies,
                )
                assert await reply_text(reader) == expected
                replies += 1
    assert proxy.cuts >= 100


async def test_cut_from_replica_a_resumed_on_replica_b_through_nginx(tmp_path: Path):
    async with cluster(tmp_path) as c:
        a_url, b_url = c.replicas
        start = await raw_request(
            f"{a_url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
        )
        reply_id = start.headers["x-reply-id"]
        await start.reader.readuntil(b"\n\n")  # the reply event
        await start.reader.readuntil(b"\n\n")  # and the first token: then the cut
        await start.aclose()  # the connection to A drops; A keeps generating (detach)
        b_addr = urlsplit(b_url).netloc
        for _ in range(4):  # round-robin: within a few requests nginx picks B
            resumed = await raw_request(
                f"{c.nginx}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "2"}
            )
            if resumed.headers.get("x-upstream") == b_addr:
                break
            await resumed.aclose()
        assert resumed.headers.get("x-upstream") == b_addr
        body = await resumed.read_body()
        whole = await raw_request(f"{b_url}/v1/replies/{reply_id}/stream")
        whole_body = await whole.read_body()
    assert whole_body.startswith(b"event: reply\nid: 1\n")
    assert whole_body.endswith(body)
    assert body.startswith(b"event: token\nid: 3\n")
    assert b"event: done" in body
    tokens = [
        json.loads(line[6:])["text"]
        for line in whole_body.split(b"\n")
        if line.startswith(b'data: {"text"')
    ]
    assert len(tokens) == 150


async def test_a_killed_replica_is_reported_as_generator_lost_on_the_other(tmp_path: Path):
    with redis_server(tmp_path) as redis:
        slow = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0")
        a_proc, a_url = await start_server(*slow, "--redis-url", redis.url)
        try:
            async with replica(*slow, "--redis-url", redis.url) as (_, b_url):
                start = await raw_request(
                    f"{a_url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
                )
                reply_id = start.headers["x-reply-id"]
                await asyncio.sleep(0.5)
                a_proc.send_signal(signal.SIGKILL)
                await a_proc.wait()
                await start.aclose()
                loop = asyncio.get_running_loop()
                began = loop.time()
                reader = await raw_request(f"{b_url}/v1/replies/{reply_id}/stream")
                body = await reader.read_body()
                waited = loop.time() - began
        finally:
            await stop(a_proc)
    events = [e for e in body.split(b"\n\n") if e]
    assert b"event: reply" in events[0]
    assert sum(1 for e in events if b"event: token" in e) >= 3  # what A logged before dying
    assert b'"code": "generator_lost"' in events[-1]
    assert waited < 10  # liveness expires after 3 s; never a hang


async def test_redis_down_keeps_plain_replies_and_refuses_resumable_ones_clearly(tmp_path: Path):
    with redis_server(tmp_path) as redis:
        async with replica(*REPLICA_ARGS, "--redis-url", redis.url) as (_, url):
            ok = await post_events(f"{url}/v1/replies", {"prompt": "x", "resumable": True})
            assert ok.types[-1] == "done"
            redis.stop()
            plain = await post_events(f"{url}/v1/replies", {"prompt": "x"})
            refused = await raw_request(
                f"{url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
            )
            refused_body = json.loads(await refused.read_body())
            redis.start()
            again = await post_events(f"{url}/v1/replies", {"prompt": "x", "resumable": True})
    assert plain.types[-1] == "done" and plain.text == ok.text
    assert refused.status == 503
    assert refused_body["error"]["code"] == "replay_store_unavailable"
    assert again.types[-1] == "done" and again.text == ok.text


async def test_a_late_reader_gets_the_whole_reply_until_the_ttl_then_404(tmp_path: Path):
    with redis_server(tmp_path) as redis:
        args = (*REPLICA_ARGS, "--redis-url", redis.url, "--reply-ttl-s", "2")
        async with replica(*args) as (_, a_url), replica(*args) as (_, b_url):
            first = await post_events(f"{a_url}/v1/replies", {"prompt": "x", "resumable": True})
            reply_id = first.headers["x-reply-id"]
            late = await raw_request(f"{b_url}/v1/replies/{reply_id}/stream")
            late_body = await late.read_body()
            await asyncio.sleep(3)
            gone = await raw_request(f"{b_url}/v1/replies/{reply_id}/stream")
            await gone.read_body()
    assert late_body == first.raw
    assert gone.status == 404


async def test_a_detached_reply_read_on_the_other_replica_goes_on_past_the_grace(tmp_path: Path):
    # The reply's own reader on A leaves; a reader on B follows it for longer than the detach
    # grace. That reader counts as one: A keeps generating to the end, as for a reader of its
    # own, rather than stopping the reply under it when the grace is over.
    with redis_server(tmp_path) as redis:
        slow = ("--engine", "simulated", "--delay-ms", "20", "--jitter-ms", "0")
        args = (*slow, "--tokens", "250", "--redis-url", redis.url, "--detach-grace-s", "2")
        async with replica(*args) as (_, a_url), replica(*args) as (_, b_url):
            start = await raw_request(
                f"{a_url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
            )
            reply_id = start.headers["x-reply-id"]
            await start.reader.readuntil(b"\n\n")  # the reply event: then A's reader leaves
            await start.aclose()
            loop = asyncio.get_running_loop()
            began = loop.time()
            resumed = await raw_request(
                f"{b_url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "1"}
            )
            body = await resumed.read_body()
            read_for = loop.time() - began
    assert read_for > 4  # twice the grace, and more
    assert b"event: done" in body and b'"code": "cancelled"' not in body
    assert body.count(b"event: token") == 250


@contextlib.asynccontextmanager
async def left_on_a(
    tmp_path: Path, grace_s: float
) -> AsyncIterator[tuple[web.Application, SimulatedEngine, str, str]]:
    """A long resumable reply started on replica A whose reader there has just left (its
    detach grace running): A, A's engine, replica B's URL and the reply's id; one Redis."""
    with redis_server(tmp_path) as redis:
        engine = fast_engine(delay_ms=20, jitter_ms=0, reply_text="word " * 2000)
        config = ServerConfig(detach_grace_s=grace_s)
        a = create_app(engine, config, RedisReplayStore(redis.url))
        b = create_app(fast_engine(), config, RedisReplayStore(redis.url))
        async with running(a) as a_url, running(b) as b_url:
            start = await raw_request(
                f"{a_url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
            )
            reply_id = start.headers["x-reply-id"]
            await start.reader.readuntil(b"\n\n")  # the reply event: then A's reader leaves
            await start.aclose()
            yield a, engine, b_url, reply_id


async def test_a_reader_joining_on_the_other_replica_late_in_the_grace_is_not_cut(
    tmp_path: Path,
):
    # Its producer learns of a reader elsewhere at its once-a-second beat: one that joined in
    # the last beat before the grace ran out was not yet known, and the reply was stopped
    # under it (detach_expired) a moment after it began to read.
    async with left_on_a(tmp_path, grace_s=1.5) as (_, _, b_url, reply_id):
        await asyncio.sleep(1.4)  # within the grace, after (most likely) A's last beat
        resumed = await raw_request(
            f"{b_url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "1"}
        )
        try:  # past when the grace, as it ran, would have ended it
            cut = await asyncio.wait_for(resumed.read_body(), timeout=2.5)
        except TimeoutError:
            cut = None  # still streaming
            await resumed.aclose()
    assert cut is None, cut[-300:]


async def test_a_detached_reply_stops_soon_after_its_reader_on_the_other_replica_leaves(
    tmp_path: Path,
):
    # The reader on B leaves past the grace: A stops the reply about the grace after that
    # (and a heartbeat or two), not after the reader's mark has lapsed too.
    async with left_on_a(tmp_path, grace_s=2.0) as (a, engine, b_url, reply_id):
        resumed = await raw_request(
            f"{b_url}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "1"}
        )
        await asyncio.sleep(3.0)  # read past the grace
        await resumed.aclose()
        loop = asyncio.get_running_loop()
        left = loop.time()
        await wait_for(lambda: not a[MANAGER_KEY].replies, timeout_s=20)
        stopped_after = loop.time() - left
    assert engine.stats().cancelled == 1  # stopped, not made to its end
    # Grace 2 s, and up to a beat to take the mark away and one for A to miss it; with the
    # mark left to lapse it took 7 s. The bound leaves a loaded machine room either side.
    assert stopped_after < 5.5, stopped_after
