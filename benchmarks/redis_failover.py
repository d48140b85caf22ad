"""Time to recover from a Redis failover under live resumable replies, and the accounting.

Runs the failover scenario of ``tests/test_redis_failover.py`` (Redis, a replica and Sentinel
on loopback, two replicas of ``replystream serve``, N live replies, the primary SIGKILLed) and
prints what every client got and how long readers waited:

    python benchmarks/redis_failover.py [--replies 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

# This folder's modules (and the delivery benchmark's), and the checkout's tests (their Redis
# helpers), from wherever it runs.
sys.path.insert(0, str(Path(__file__).resolve().parent / "delivery"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.failover_scenario import run
from tier import find_binary

from replystream.cli_values import positive_int
from tool_main import tool_main

PROGRAMS = ("redis-server", "redis-sentinel", "redis-cli")  # what the scenario starts and asks


async def main(replies: int, runs: int) -> None:
    failovers, stalls = [], []
    for n in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            outcome = await run(Path(tmp), replies=replies)
        print(f"run {n + 1}: {outcome.summary()}")
        failovers.append(outcome.failover_s)
        stalls.append(max(outcome.stalls_s or [0.0]))
    print(
        f"median over {runs} runs: Sentinel failover {statistics.median(failovers):.2f} s, "
        f"longest reader stall {statistics.median(stalls):.2f} s"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replies", type=positive_int, default=200)
    parser.add_argument("--runs", type=positive_int, default=3)
    options = parser.parse_args()
    missing = [name for name in PROGRAMS if find_binary(name) is None]
    if missing:
        parser.error(
            f"{', '.join(missing)} not installed (Debian packages redis-server, redis-sentinel "
            "and redis-tools), or not on PATH nor in sbin"
        )
    asyncio.run(main(options.replies, options.runs))


if __name__ == "__main__":
    tool_main(cli)
