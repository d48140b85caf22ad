"""Time to recover from a Redis failover under live resumable replies, and the accounting.

Runs the failover scenario of ``tests/test_redis_failover.py`` (Redis, a replica and Sentinel
on loopback, two replicas of ``replystream serve``, N live replies, the primary SIGKILLed) and
prints what every client got and how long readers waited:

    python -m benchmarks.redis_failover [--replies 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from tests.failover_scenario import run

from replystream.cli_values import positive_int


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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replies", type=positive_int, default=200)
    parser.add_argument("--runs", type=positive_int, default=3)
    options = parser.parse_args()
    asyncio.run(main(options.replies, options.runs))
