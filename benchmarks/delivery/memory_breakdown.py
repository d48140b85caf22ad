"""Where a live stream's memory goes: Python heap per open stream, by line and by object type.

Serves replystream (or the bare aiohttp baseline) in this process, opens C streams with the
load client in a child process, and ``--after-s`` seconds later, while every stream is open,
compares the heap with the one before the burst: tracemalloc's bytes per stream by the line
that allocated them (and by the innermost replystream frame, so what a library allocates for
a replystream call is charged to that call), and the garbage collector's live objects per
stream by type (coroutine frames by function). Tracing slows the server several times over,
so the streams fall behind; the bytes they hold are what matters here. ``--untraced`` skips
the tracer: the resident memory per open stream (what the delivery benchmark, ``run.py``,
measures) and the live objects, at the server's own speed.

Run: python benchmarks/delivery/memory_breakdown.py [--server replystream|bare] [-C 1000]
     [--untraced]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from procstats import memory_kib, raise_nofile
from run import WARMUP_STREAMS, WARMUP_TOKENS, run_client
from workload import stream_seeds

from replystream.cli_values import int_between, non_negative_float, positive_int

# The benchmarks' shared modules (tool_main), beside this folder's own.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tool_main import tool_main

OURS = "/replystream/"


@asynccontextmanager
async def serving(server: str) -> AsyncIterator[str]:
    """The server under study, in this process (so its heap can be traced); yields its URL."""
    if server == "replystream":
        from replystream.engine import SimulatedConfig, SimulatedEngine
        from replystream.server.app import create_app
        from replystream.server.serve import running, tune_collector

        app = create_app(SimulatedEngine(SimulatedConfig(delay_ms=33, jitter_ms=8)))
        async with running(app) as url:
            tune_collector()  # as `replystream serve` does
            yield url
        return
    import bare_app

    runner = await bare_app.started("127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def live_objects() -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Bytes and counts of the collector's live objects by type (coroutines by function)."""
    size: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for item in gc.get_objects():
        kind = type(item)
        name = f"{getattr(kind, '__module__', '?')}.{kind.__qualname__}"
        if kind.__name__ == "coroutine":
            name = f"coroutine {item.cr_code.co_qualname}"
        size[name] += sys.getsizeof(item)
        count[name] += 1
    return size, count


def where(trace: tracemalloc.StatisticDiff, ours_first: bool) -> str:
    frames = list(trace.traceback)  # oldest first
    if ours_first:
        mine = [frame for frame in frames if OURS in frame.filename]
        if mine:
            frame = mine[-1]
            return f"{frame.filename.split(OURS)[-1]}:{frame.lineno}"
    frame = frames[-1]
    return f"{frame.filename.split('site-packages/')[-1].split('/lib/python')[-1]}:{frame.lineno}"


def table(title: str, rows: list[tuple[str, float, float]], streams: int, top: int) -> list[str]:
    lines = [f"\n{title}", f"{'bytes/stream':>12} {'objects/stream':>14}  where"]
    for name, nbytes, objects in sorted(rows, key=lambda row: -row[1])[:top]:
        lines.append(f"{nbytes / streams:12.0f} {objects / streams:14.2f}  {name}")
    return lines


def grouped(
    diffs: list[tracemalloc.StatisticDiff], key: Callable[[tracemalloc.StatisticDiff], str]
) -> list[tuple[str, float, float]]:
    nbytes: collections.Counter[str] = collections.Counter()
    objects: collections.Counter[str] = collections.Counter()
    for diff in diffs:
        nbytes[key(diff)] += diff.size_diff
        objects[key(diff)] += diff.count_diff
    return [(name, float(nbytes[name]), float(objects[name])) for name in nbytes]


async def study(
    server: str, streams: int, after_s: float, top: int, frames: int, traced: bool
) -> list[str]:
    async with serving(server) as url:
        # Warm up as the benchmark does. Without it the burst's first thousand connections are
        # made before any response has set its attributes, and CPython 3.11 then gives every
        # one of them a dict for aiohttp's writer and request: 1.3 KiB a stream that a warm
        # server does not pay.
        warm = stream_seeds(WARMUP_STREAMS, 1)
        await run_client(f"{url}/v1/replies", warm, WARMUP_TOKENS, 30.0)
        gc.collect()
        rss_before = memory_kib([os.getpid()], "VmRSS")
        if traced:
            tracemalloc.start(frames)
            before = tracemalloc.take_snapshot()
        size_before, count_before = live_objects()
        seeds = list(range(1000, 1000 + streams))
        client = asyncio.create_task(run_client(f"{url}/v1/replies", seeds, None, 120.0))
        await asyncio.sleep(after_s)
        rss_after = memory_kib([os.getpid()], "VmRSS")
        # Objects first: the snapshot is itself a heap of lists and tuples.
        size_after, count_after = live_objects()
        if traced:
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
        result: dict[str, Any] = await client
    lines = [
        f"{server}: {streams} streams, heap {after_s:g} s into the run "
        f"(the run: {result['completed']}/{streams} completed, peak {result['peak_open']} open)",
        f"resident memory per open stream: {(rss_after - rss_before) / streams:.2f} KiB"
        + (" (traced: slower, and the tracer's own memory)" if traced else ""),
    ]
    if traced:
        lines += traced_tables(before, after, streams, top)
    types = [
        (
            name,
            float(size_after[name] - size_before[name]),
            float(count_after[name] - count_before[name]),
        )
        for name in size_after
    ]
    lines += table("live objects by type (shallow sizes)", types, streams, top)
    return lines


def traced_tables(
    before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, streams: int, top: int
) -> list[str]:
    diffs = after.compare_to(before, "traceback")
    total = sum(diff.size_diff for diff in diffs)
    lines = [f"traced heap per open stream: {total / streams:,.0f} bytes"]
    lines += table("by allocating line", grouped(diffs, lambda d: where(d, False)), streams, top)
    lines += table(
        "by innermost replystream frame (else the allocating line)",
        grouped(diffs, lambda d: where(d, True)),
        streams,
        top,
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["replystream", "bare"], default="replystream")
    parser.add_argument("-C", "--concurrency", type=positive_int, default=1000)
    parser.add_argument(
        "--after-s", type=non_negative_float, default=3.0, help="when to look, from the burst"
    )
    parser.add_argument("--top", type=positive_int, default=30, help="rows per table")
    parser.add_argument(
        "--frames",
        type=int_between(1, 65535),  # tracemalloc's own range
        help="stack frames kept per allocation (default 1): more finds the replystream call "
        "behind a library's allocation, but slows the server so that it falls behind the "
        "schedule",
    )
    parser.add_argument(
        "--untraced",
        action="store_true",
        help="no tracemalloc: resident memory and live objects only, at the server's own speed "
        "(what the delivery benchmark measures, by type)",
    )
    args = parser.parse_args()
    if args.untraced and args.frames is not None:
        parser.error("argument --frames: the tracer's, which --untraced leaves off")
    raise_nofile()
    frames = 1 if args.frames is None else args.frames
    lines = study(args.server, args.concurrency, args.after_s, args.top, frames, not args.untraced)
    print("\n".join(asyncio.run(lines)))


if __name__ == "__main__":
    tool_main(main)
