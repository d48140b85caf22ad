"""Readers on one replica following replies produced on another, through Redis.

Starts a fresh redis-server on a free loopback port and two stores on it in this process:
the producer's, and the reader's (another replica: no local copy, it reads the streams).
R readers start over about a second (as resumes arrive), then every reply gets one entry
every 30 ms and ends. Prints how many readers got exactly their entries and ending, the
failures by reason, the process's CPU per entry delivered (both stores: the producer's
share is the write path, a few µs) and the reader's shared XREAD calls.

Run: python benchmarks/delivery/redis_followers.py [--readers 90] [--entries 20]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

from tier import started_redis

from replystream.cli_values import positive_int
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo, StoreUnavailable

# The benchmarks' shared modules (tool_main), beside this folder's own.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tool_main import tool_main


async def follow(reader: RedisReplayStore, reply_id: str, delay_s: float) -> list[str]:
    await asyncio.sleep(delay_s)
    cursor = reader.cursor(reply_id, 0)
    seen: list[str] = []
    while True:
        result = await cursor.read(wait_s=2.0)
        if result is None or result.producer_lost:
            raise RuntimeError("reply lost")
        seen += [entry.data for entry in result.entries]
        if result.entries:
            cursor.sent(result.entries[-1].seq, 0)
        if result.ending is not None:
            return seen


async def produce(producer: RedisReplayStore, ids: list[str], entries: int) -> None:
    await asyncio.sleep(1.5)
    for seq in range(1, entries + 1):
        for reply_id in ids:
            producer.append(reply_id, [LogEntry(seq, "token", f"{reply_id}/{seq}")])
        await asyncio.sleep(0.03)
    for reply_id in ids:
        producer.end(reply_id, "finished")


async def measure(args: argparse.Namespace) -> None:
    async with started_redis() as redis:
        producer, reader = RedisReplayStore(redis.url), RedisReplayStore(redis.url)
        ids = [f"reply-{n}" for n in range(args.readers)]
        for start in range(0, len(ids), 50):
            await asyncio.gather(*(producer.create(ReplyInfo(i)) for i in ids[start : start + 50]))
        spread = 1.2 / max(1, len(ids))
        cpu = time.process_time()
        outcomes = await asyncio.gather(
            produce(producer, ids, args.entries),
            *(follow(reader, reply_id, n * spread) for n, reply_id in enumerate(ids)),
            return_exceptions=True,
        )
        cpu = time.process_time() - cpu
        # (read with getattr, so the script also measures revisions before the shared read,
        # and those that kept it on the store itself)
        watch = getattr(getattr(reader, "reads", None), "watch", None)
        calls = getattr(watch or getattr(reader, "_watch", None), "calls", None)
        await producer.aclose()
        await reader.aclose()
    failures: Counter[str] = Counter()
    exact = 0
    for reply_id, outcome in zip(ids, outcomes[1:], strict=True):
        if isinstance(outcome, StoreUnavailable | RuntimeError):
            failures[str(outcome).split(": ", 1)[-1]] += 1
        elif isinstance(outcome, BaseException):
            raise outcome
        elif outcome == [f"{reply_id}/{seq}" for seq in range(1, args.entries + 1)]:
            exact += 1
    print(
        f"{exact}/{len(ids)} readers got exactly their entries; "
        f"{cpu / (len(ids) * args.entries) * 1e6:.1f} µs CPU per entry delivered"
        + (f"; {calls} shared XREAD calls" if calls is not None else "")
    )
    for reason, count in failures.items():
        print(f"  failed x{count}: {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=positive_int, default=90)
    parser.add_argument("--entries", type=positive_int, default=20)
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    tool_main(main)
