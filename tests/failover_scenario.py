"""Live resumable replies while the Redis primary is SIGKILLed and Sentinel promotes its
replica: what every client got, counted (the failover test and ``benchmarks/redis_failover``).

Two ``replystream serve`` replicas share Redis through Sentinel. Each client starts a reply on
one replica; half read it there (from the producer's memory), half drop that connection after
the first event and follow the reply from the other replica (through Redis). The primary is
killed while every reply is mid-stream. Each client's events are checked against the engine's
text (the simulated engine's is fixed): exact, or told (a ``gap`` event, or an ``error``
naming why), or a silent loss; and an event id seen twice is a duplicate.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from replystream.client.transport import http_request
from replystream.lab.local_server import serve_process
from replystream.sse import EventParser
from tests.redis_server import redis_with_sentinel

ENGINE = ("--engine", "simulated", "--delay-ms", "30", "--jitter-ms", "5", "--tokens", "200")


@dataclass
class Client:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    gaps: int = 0
    error: str | None = None
    done: bool = False
    arrivals: list[float] = field(default_factory=list)

    @property
    def duplicated(self) -> int:
        return len(self.ids) - len(set(self.ids))


@dataclass
class Outcome:
    clients: int
    exact: int
    told_gap: int
    told_error: collections.Counter[str]
    silent: int
    duplicated: int
    failover_s: float  # SIGKILL -> Sentinel names the replica as primary
    stalls_s: list[float]  # per remote reader: its longest wait for an event after the kill

    def summary(self) -> str:
        stalls = sorted(self.stalls_s) or [0.0]
        return (
            f"clients {self.clients}: exact {self.exact}, told of a gap {self.told_gap}, "
            f"told an error {dict(self.told_error)}, silent losses {self.silent}, "
            f"duplicated ids {self.duplicated}; Sentinel failover {self.failover_s:.2f} s; "
            f"remote readers' longest stall: median {statistics.median(stalls):.2f} s, "
            f"max {stalls[-1]:.2f} s"
        )


async def read_stream(
    url: str,
    client: Client,
    *,
    body: bytes = b"",
    after: int | None = None,
    first_only=False,
    stop_after: int | None = None,
) -> str | None:
    """Read a reply's events into ``client`` (POST ``body``, or GET after event ``after``);
    the reply's id, from its first event. With ``first_only``, stop after that event; with
    ``stop_after``, after that many (the client drops the connection)."""
    if first_only:
        stop_after = 1
    read = 0
    headers = {"Accept": "text/event-stream"}
    if body:
        headers["Content-Type"] = "application/json"
    if after is not None:
        headers["Last-Event-ID"] = str(after)
    reply_id = None
    method = "POST" if body else "GET"
    async with http_request(url, method=method, body=body, headers=headers) as response:
        if response.status != 200:  # refused (a 503 while Redis is unreachable): told
            client.error = f"http_{response.status}"
            return None
        parser = EventParser()
        async for chunk in response:
            for event in parser.feed(chunk.data):
                client.arrivals.append(time.monotonic())
                if event.type == "gap":
                    client.gaps += 1
                elif event.type == "error":
                    client.error = json.loads(event.data)["error"]["code"]
                    return reply_id
                elif event.id and event.id.isdigit():
                    client.ids.append(int(event.id))
                    if event.type == "reply":
                        reply_id = json.loads(event.data)["reply_id"]
                    elif event.type == "token":
                        client.text += json.loads(event.data)["text"]
                    elif event.type == "done":
                        client.done = True
                read += 1
                if stop_after is not None and read >= stop_after:
                    return reply_id
    return reply_id


async def one_client(producer: str, reader: str, client: Client) -> None:
    body = b'{"prompt": "x", "resumable": true}'
    url = f"{producer}/v1/replies"
    if producer == reader:
        await read_stream(url, client, body=body)
        return
    # Drop the producer's connection after the first event (the reply goes on: resumable)
    # and follow the reply from the other replica, through Redis.
    reply_id = await read_stream(url, client, body=body, first_only=True)
    if reply_id is None:
        return
    await read_stream(f"{reader}/v1/replies/{reply_id}/stream", client, after=client.ids[-1])


def account(clients: list[Client], expected: str) -> tuple[int, int, collections.Counter[str], int]:
    exact = told_gap = silent = 0
    told_error: collections.Counter[str] = collections.Counter()
    for client in clients:
        if client.done and client.text == expected and not client.gaps:
            exact += 1
        elif client.gaps:
            told_gap += 1
        elif client.error is not None:
            told_error[client.error] += 1
        else:
            silent += 1
    return exact, told_gap, told_error, silent


async def run(
    tmp: Path, replies: int = 200, kill_after_s: float = 1.0, failover_s: float = 20
) -> Outcome:
    """Start ``replies`` replies, kill the Redis primary ``kill_after_s`` after they have
    all begun; account for what every client got."""
    with redis_with_sentinel(tmp / "redis") as redis:
        args = (*ENGINE, "--redis-url", redis.url, "--redis-failover-s", str(failover_s))
        # Started as tools start servers: a Ctrl-C of the benchmark stops them quietly.
        async with serve_process(args) as a, serve_process(args) as b:
            a_url, b_url = a.url, b.url
            reference = Client()
            await read_stream(f"{a_url}/v1/replies", reference, body=b'{"prompt": "x"}')
            pairs = [(a_url, a_url), (a_url, b_url), (b_url, b_url), (b_url, a_url)]
            clients = [Client() for _ in range(replies)]
            loop = asyncio.get_running_loop()
            async with asyncio.TaskGroup() as group:
                for n, client in enumerate(clients):
                    producer, reader = pairs[n % len(pairs)]
                    group.create_task(one_client(producer, reader, client))
                # Every reply begun (its first event read), then mid-stream: the kill.
                async with asyncio.timeout(60):
                    while sum(1 for c in clients if c.ids) < replies:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                await asyncio.sleep(kill_after_s)
                killed_at = time.monotonic()
                redis.primary.kill()
                await loop.run_in_executor(None, redis.wait_for_failover)
                failover = time.monotonic() - killed_at
    exact, told_gap, told_error, silent = account(clients, reference.text)
    stalls = []
    for n, client in enumerate(clients):
        if pairs[n % len(pairs)][0] == pairs[n % len(pairs)][1]:
            continue
        after = [t for t in client.arrivals if t >= killed_at]
        if after:
            times = [killed_at, *after]
            stalls.append(max(b - a for a, b in itertools.pairwise(times)))
    return Outcome(
        replies,
        exact,
        told_gap,
        told_error,
        silent,
        sum(c.duplicated for c in clients),
        failover,
        stalls,
    )
