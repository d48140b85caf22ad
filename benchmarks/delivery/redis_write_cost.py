"""The Redis store's write path alone: CPU per event of ``append`` plus ``flush``.

Starts a fresh redis-server on a free loopback port, creates R replies at once, then, for
each round, appends one token entry to every reply and flushes, as a replica does when
R replies each produce one event between two flushes (the case where batching across
replies is all there is to batch). Prints the median over rounds of this process's CPU
time per event (the local copy every replica keeps included), and the calls sent to Redis.
Nothing else runs in the process, so the figure is the store's own.

Run: python benchmarks/delivery/redis_write_cost.py [--replies 1000] [--rounds 5]
         [--flushes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from tier import started_redis

from replystream.cli_values import positive_int
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import LogEntry, ReplyInfo

# The benchmarks' shared modules (tool_main), beside this folder's own.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tool_main import tool_main

DATA = '{"text": "word ", "tokens": 1}'


async def measure(args: argparse.Namespace) -> None:
    async with started_redis() as redis:
        store = RedisReplayStore(redis.url)
        ids = [f"reply-{n}" for n in range(args.replies)]
        for start in range(0, len(ids), 50):  # the pool holds 100 connections at most
            batch = ids[start : start + 50]
            await asyncio.gather(*(store.create(ReplyInfo(i)) for i in batch))
        per_event = []
        seq = 0
        writes = store.writer.writes
        for _ in range(args.rounds):
            cpu = time.process_time()
            for _ in range(args.flushes):
                seq += 1
                entry = [LogEntry(seq, "token", DATA)]
                for reply_id in ids:
                    store.append(reply_id, entry)
                await store.flush()
            per_event.append((time.process_time() - cpu) / (args.flushes * len(ids)) * 1e6)
        calls = (store.writer.writes - writes) / (args.rounds * args.flushes)
        await store.aclose()
    print(
        f"append + flush, {args.replies:,} replies x 1 entry per flush: "
        f"{statistics.median(per_event):.2f} µs CPU per event "
        f"(rounds: {', '.join(f'{v:.2f}' for v in per_event)}; {calls:g} call(s) per flush)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=positive_int, default=1000)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--flushes", type=positive_int, default=20, help="per round")
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    tool_main(main)
