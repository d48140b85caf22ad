"""Redis memory per reply log: measured against the sizing formula of docs/deploy/replicas.md.

Starts a redis-server on loopback, writes N ended replies of each shape (E events of D bytes
of data, with the event type a route logs) through ``RedisReplayStore`` exactly as a replica
does, and prints, per shape, Redis's own count (``INFO memory`` used_memory before and after,
over N) and ``MEMORY USAGE`` of one reply's keys, beside the formula's prediction:

    python benchmarks/redis_memory.py [--replies 300]

The formula (bytes a reply holds in Redis for the TTL after its end):
    reply = FIXED + E * (D + T + PER_EVENT) + context
    FIXED     = 4,600 B: the stream's newest node (Redis 7 allocates it whole: a 4 KB listpack,
                ``stream-node-max-bytes``), the stream and its radix tree, the metadata hash,
                and the keys in Redis's dictionaries with their expiry
    T         = the event type's length ("token": 5; 0 for a plain message, as chat chunks are)
    PER_EVENT = 22 B: an entry's header, its id as deltas, the offset field (``b``), and
                listpack backlengths (the field names are stored once per node)
The stream grows in 4 KB nodes, so a reply sits on a step: the formula is within about 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# This folder's modules (and the delivery benchmark's), and the checkout's tests (their Redis
# helpers), from wherever it runs.
sys.path.insert(0, str(Path(__file__).resolve().parent / "delivery"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.redis_server import redis_server
from tier import find_binary

from replystream.cli_values import positive_int
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo
from tool_main import tool_main

FIXED = 4_600
PER_EVENT = 22
# A chat.completion.chunk as the OpenAI route logs it (one word of content): 216 bytes.
CHUNK = json.dumps(
    {
        "id": "chatcmpl-" + "x" * 24,
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "replystream-simulated",
        "choices": [{"index": 0, "delta": {"content": "word "}, "finish_reason": None}],
    }
)


def predicted(events: int, data: int, event_type: str | None, context: int = 0) -> int:
    return FIXED + events * (data + len(event_type or "") + PER_EVENT) + context


@dataclass(frozen=True)
class Shape:
    name: str
    events: int
    data: str
    event_type: str | None


SHAPES = [
    Shape("native, 10 tokens", 10, '{"text": "word "}', "token"),
    Shape("native, 120 tokens", 120, '{"text": "word "}', "token"),
    Shape("native, 1,000 tokens", 1000, '{"text": "word "}', "token"),
    Shape("chat chunks, 120", 120, CHUNK, None),
    Shape("chat chunks, 1,000", 1000, CHUNK, None),
]


async def measure(store: RedisReplayStore, shape: Shape, replies: int, tag: str) -> tuple[int, int]:
    """(used_memory grown per reply, MEMORY USAGE of one reply's keys)."""
    before = (await store.redis.info("memory"))["used_memory"]
    for n in range(replies):
        reply = f"{tag}-{n}"
        await store.create(ReplyInfo(reply, owner="0123456789abcdef"))
        store.append(
            reply, [LogEntry(i, shape.event_type, shape.data) for i in range(1, shape.events + 1)]
        )
        store.end(reply, "finished")
        if n % 50 == 49:
            await store.flush()
    await store.flush()
    after = (await store.redis.info("memory"))["used_memory"]
    one = 0
    for part in ("", ":meta"):
        one += await store.redis.memory_usage(store.keys.key(f"{tag}-0", part), samples=0) or 0
    return (after - before) // replies, one


async def main(replies: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as server:
        store = RedisReplayStore(server.url)
        print(f"{replies} ended replies per shape; bytes per reply")
        print(
            f"{'shape':<22}{'D':>5}{'used_memory':>13}{'MEMORY USAGE':>14}"
            f"{'formula':>9}{'ratio':>7}"
        )
        for n, shape in enumerate(SHAPES):
            grown, usage = await measure(store, shape, replies, f"s{n}")
            expect = predicted(shape.events, len(shape.data), shape.event_type)
            print(
                f"{shape.name:<22}{len(shape.data):>5}{grown:>13,}{usage:>14,}{expect:>9,}"
                f"{grown / expect:>7.2f}"
            )
        await store.aclose()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replies", type=positive_int, default=300)
    replies = parser.parse_args().replies
    if find_binary("redis-server") is None:
        parser.error(
            "redis-server is not installed (Debian package redis-server), or not on PATH nor "
            "in sbin"
        )
    asyncio.run(main(replies))


if __name__ == "__main__":
    tool_main(cli)
