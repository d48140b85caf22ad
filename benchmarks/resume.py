"""Resume costs: time from reconnect to the first replayed event, and the server CPU per event
of logging replies to Redis instead of memory.

Starts a redis-server (found on PATH or in sbin, on a free loopback port, as the delivery
benchmark's) and replicas of ``replystream serve`` with the simulated engine. Everything is
measured side by side in one run.

Run: python benchmarks/resume.py [--repeats 20] [--replies 40] [--tokens 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the delivery benchmark's Redis
    sys.path.insert(0, str(Path(__file__).resolve().parent / "delivery"))

from tier import find_binary, started_redis

from replystream.cli_values import int_between, positive_int
from replystream.client.transport import http_request
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.lab.local_server import serve_process
from replystream.sse import EventParser
from replystream.stats import percentile
from tool_main import tool_main

TICKS = os.sysconf("SC_CLK_TCK")
# Each reply is cut after this many events and resumed from half of them: its reply must
# be at least this many tokens long to be cut while it streams.
CUT_AT = 20


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def first_event_after(url: str, reply_id: str, after: int) -> float:
    """ms from sending a resume request to parsing its first event."""
    headers = {"Last-Event-ID": str(after)}
    started = time.perf_counter()
    async with http_request(f"{url}/v1/replies/{reply_id}/stream", headers=headers) as response:
        parser = EventParser()
        async for chunk in response:
            if parser.feed(chunk.data):
                return (chunk.at - started) * 1000.0
    raise RuntimeError("no event")


async def start_and_cut(url: str, events: int) -> str:
    body = b'{"prompt": "x", "resumable": true}'
    async with http_request(
        f"{url}/v1/replies", method="POST", body=body, headers={"Content-Type": "application/json"}
    ) as response:
        parser = EventParser()
        seen = 0
        async for chunk in response:
            seen += len(parser.feed(chunk.data))
            if seen >= events:
                return response.headers["x-reply-id"]
    raise RuntimeError("reply ended early")


async def stream_replies(url: str, replies: int) -> int:
    async def one() -> int:
        body = b'{"prompt": "x", "resumable": true}'
        parser = EventParser()
        count = 0
        async with http_request(
            f"{url}/v1/replies",
            method="POST",
            body=body,
            headers={"Content-Type": "application/json"},
        ) as response:
            async for chunk in response:
                count += len(parser.feed(chunk.data))
        return count

    counts = await asyncio.gather(*(one() for _ in range(replies)))
    return sum(counts)


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):6.2f} ms, p95 {percentile(values, 95):6.2f} ms"


async def measure(args: argparse.Namespace) -> None:
    common = ["--engine", "simulated", "--tokens", str(args.tokens), "--delay-ms", "1"]
    common += ["--jitter-ms", "0"]
    async with (
        started_redis() as redis,
        serve_process(common) as memory,
        serve_process([*common, "--redis-url", redis.url]) as redis_a_server,
        serve_process([*common, "--redis-url", redis.url]) as redis_b_server,
    ):
        memory_url, redis_a, redis_b = memory.url, redis_a_server.url, redis_b_server.url
        same, other, local = [], [], []
        for _ in range(args.repeats):
            reply_id = await start_and_cut(memory_url, CUT_AT)
            local.append(await first_event_after(memory_url, reply_id, CUT_AT // 2))
            reply_id = await start_and_cut(redis_a, CUT_AT)
            same.append(await first_event_after(redis_a, reply_id, CUT_AT // 2))
            other.append(await first_event_after(redis_b, reply_id, CUT_AT // 2))
        print(f"Reconnect to first replayed event ({args.repeats} resumes each)")
        print(f"  memory store, same replica      {summary(local)}")
        print(f"  Redis store, same replica       {summary(same)}")
        print(f"  Redis store, other replica      {summary(other)}")

        costs = {}
        for name, server in (("memory", memory), ("redis", redis_a_server)):
            before = cpu_seconds(server.pid)
            events = await stream_replies(server.url, args.replies)
            costs[name] = (cpu_seconds(server.pid) - before) / events * 1e6
        print(
            f"Server CPU per event ({args.replies} resumable replies of "
            f"{args.tokens} tokens at once)"
        )
        memory_us, redis_us = costs["memory"], costs["redis"]
        # A few replies may cost the memory store less than one clock tick (10 ms): no ratio.
        times = f"x{redis_us / memory_us:.2f}" if memory_us else "x -"
        print(f"  memory store  {memory_us:6.1f} us")
        print(f"  Redis store   {redis_us:6.1f} us (+{redis_us - memory_us:.1f} us, {times})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--replies", type=positive_int, default=40)
    parser.add_argument("--tokens", type=int_between(CUT_AT, MAX_TOKENS_LIMIT), default=400)
    args = parser.parse_args()
    if find_binary("redis-server") is None:
        parser.error(
            "redis-server is not installed (Debian package redis-server), or not on PATH "
            "nor in sbin: the Redis store is half of what this measures"
        )
    asyncio.run(measure(args))


if __name__ == "__main__":
    tool_main(main)
