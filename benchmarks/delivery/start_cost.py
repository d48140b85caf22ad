"""What starting a reply costs: server CPU per request for a burst of one-token replies.

At 1,000 streams opened at once, events are late mostly because the requests are accepted
and started one after another before the first tokens are due; the per-event cost hardly
matters there. This measures the start alone, side by side: each server fresh, warmed up,
then a burst of N requests for one token each (accept, parse, start, headers, one token, the
end, close). Reports the server's user and system CPU per request and the run's lateness
p99, medians over the rounds, servers interleaved round by round.

Run: python benchmarks/delivery/start_cost.py [-N 1000] [--rounds 3] [--servers replystream bare]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from procstats import cpu_split, process_tree, raise_nofile
from run import run_client
from servers import SERVER_NAMES, started_server
from workload import stream_seeds

from replystream.cli_values import positive_int

# The benchmarks' shared modules (tool_main), beside this folder's own.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tool_main import tool_main


async def one_burst(name: str, requests: int) -> tuple[float, float, float]:
    """User and system CPU (µs per request) and lateness p99 (ms) of one burst on a fresh server."""
    async with started_server(name) as server:
        await run_client(server.url, stream_seeds(20, 1), 2, 30.0)  # warm-up
        pids = process_tree(server.pid)
        user_before, system_before = cpu_split(pids)
        result = await run_client(server.url, stream_seeds(requests), 1, 60.0)
        user_after, system_after = cpu_split(pids)
    if result["failed"]:
        raise RuntimeError(f"{name}: {result['failed']} requests failed: {result['failures']}")
    per_request = 1e6 / requests
    return (
        (user_after - user_before) * per_request,
        (system_after - system_before) * per_request,
        result["lateness_ms"]["p99"],
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-N", "--requests", type=positive_int, default=1000)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--servers", nargs="+", choices=SERVER_NAMES, default=["replystream", "bare"]
    )
    args = parser.parse_args()
    raise_nofile()
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in args.servers}
    for _ in range(args.rounds):
        for name in args.servers:
            runs[name].append(await one_burst(name, args.requests))
    print(f"{args.requests} one-token replies at once, median of {args.rounds} rounds")
    print(
        f"{'server':>12} {'user µs':>8} {'system µs':>10} {'total µs':>9} {'lateness p99 ms':>16}"
    )
    for name, rounds in runs.items():
        user, system, late = (statistics.median(column) for column in zip(*rounds, strict=True))
        print(f"{name:>12} {user:8.0f} {system:10.0f} {user + system:9.0f} {late:16.0f}")
    print("(CPU is read in 10 ms clock ticks: about 10 µs per request at N = 1,000)")


if __name__ == "__main__":
    tool_main(lambda: asyncio.run(main()))
