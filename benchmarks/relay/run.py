"""Relay benchmark: replystream, LiteLLM's proxy and nginx in front of one fast upstream.

In one run: a fast OpenAI-compatible upstream in its own process (``upstream_server.py``:
every reply ``--chunks`` chunks ``--interval-ms`` apart, the first with the response head, or
``--first-chunk-ms`` after it as a model's prefill would keep it; the upstream is never the
bottleneck), and each relay in front of it on one process
(``relays.py``). For each concurrency C (its rounds one after another, and within a round
each target in turn, the upstream measured directly first), a load client in its own
process (``relay_client.py``) keeps C streamed chat completions open at once through each
target: C slots, started evenly over one reply's length, each streaming
``--replies-per-slot`` replies one after another (``--burst``: the C slots start at once).
Measured per target and C, over every stream:
- time to the first chunk, p50 and p99, and what the relay adds to it (the relay's
  percentile minus the upstream's own, measured directly in the same round);
- the largest gap between two chunks of a stream, less the upstream's interval: p99 over
  streams (the upstream's own row is what the schedule and the client add alone);
- the target process's CPU time (user + system, /proc) per chunk the clients received;
  ``native`` (replystream making the same replies itself, ``relays.py``) is the peer that
  says what relaying adds to native delivery (its own added time to the first chunk is shown
  when its schedule is the upstream's: ``--first-chunk-ms`` at least one interval);
- the target's peak resident memory during the run less its memory once warmed up and
  idle (before its first run), per stream;
- streams completed (a relay that cannot keep up is bounded by ``--timeout-s`` after the
  reply's length, its unfinished streams counted as cut).
Every figure is the median over the rounds. Then the relay's own parse and re-encode cost per
chunk, apart from its socket work (``parse_cost.py``). See docs/performance.md.

Run: python benchmarks/relay/run.py [--quick] [-C 1 100 500 1000] [--rounds 3]
         [--relays replystream litellm nginx pipe parse-pipe native] [--litellm PATH]
         [--loop asyncio|uvloop] [--workers N] [--first-chunk-ms 0]
         [--replies-per-slot 2] [--burst] [--timeout-s 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the delivery benchmark's modules, and ours
    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "delivery")]

from bytecode import write_bytecode
from procstats import (
    cpu_seconds,
    machine_busy_seconds,
    memory_kib,
    process_tree,
    raise_nofile,
)

from relay import parse_cost
from relay.relays import (
    API_KEY,
    RELAYS,
    Target,
    litellm_relay,
    native_server,
    nginx_binary,
    nginx_relay,
    pipe_relay,
    replystream_relay,
    upstream_server,
)
from relay.upstream_server import CHUNKS, INTERVAL_MS
from replystream.lab.local_server import owned_child, stop_process
from replystream.stats import percentile
from tool_main import tool_main

CLIENT = Path(__file__).resolve().parent / "relay_client.py"
QUIET_CORES = 0.05
SAMPLE_S = 0.1


async def wait_idle(pids: list[int], limit_s: float = 15.0) -> None:
    """Wait until the target has stopped working on the last run (bounded)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = cpu_seconds(pids)
        await asyncio.sleep(0.2)
        if (cpu_seconds(pids) - before) / 0.2 < QUIET_CORES:
            return


async def run_client(config: dict[str, Any]) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CLIENT),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        **owned_child(),
    )
    try:
        out, _ = await process.communicate(json.dumps(config).encode())
    finally:  # interrupted: the client is stopped with the run
        await stop_process(process)
    if process.returncode != 0:
        raise RuntimeError(f"the load client failed with status {process.returncode}")
    result: dict[str, Any] = json.loads(out)
    return result


async def measure(
    target: Target, streams: int, args: argparse.Namespace, idle: dict[str, int]
) -> dict[str, Any]:
    """One run of ``streams`` streams through ``target``: its figures. ``idle`` holds each
    target's memory before its first run (a process keeps what it once allocated, so the
    memory before a later run is not what its streams cost)."""
    pids = process_tree(target.pid)
    await wait_idle(pids)
    rss_before = memory_kib(pids, "VmRSS")
    idle_kib = idle.setdefault(target.name, rss_before)  # after the warm-up, before any run
    cpu_before = cpu_seconds(pids)
    busy_before, started = machine_busy_seconds(), time.monotonic()
    reply_s = (args.first_chunk_ms + args.chunks * args.interval_ms) / 1000
    spread_s = 0.0 if args.burst else reply_s
    config = {
        "url": target.url,
        "streams": streams,
        "replies_per_slot": args.replies_per_slot,
        "spread_s": spread_s,
        "api_key": API_KEY,
        "timeout_s": spread_s + reply_s * args.replies_per_slot + args.timeout_s,
    }
    client = asyncio.ensure_future(run_client(config))
    peak = rss_before
    while not client.done():
        await asyncio.wait([client], timeout=SAMPLE_S)
        peak = max(peak, memory_kib(pids, "VmRSS"))
    result = client.result()
    cpu = cpu_seconds(pids) - cpu_before
    busy = (machine_busy_seconds() - busy_before) / (time.monotonic() - started)
    chunks = result["chunks"]
    gap_s = [gap - args.interval_ms / 1000 for gap in result["max_gap_s"]]
    ms = 1000.0
    return {
        "streams": result["streams"],
        "completed": result["completed"],
        "failures": result["failures"],
        "first_p50_ms": percentile(result["first_s"], 50) * ms,
        "first_p99_ms": percentile(result["first_s"], 99) * ms,
        "gap_p99_ms": percentile(gap_s, 99) * ms,
        "cpu_us_per_chunk": cpu / chunks * 1e6 if chunks else math.nan,
        "kib_per_stream": (peak - idle_kib) / streams,  # C streams open at most
        "machine_busy_cores": busy,
    }


def median(rounds: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rounds if not math.isnan(r[key])]
    return statistics.median(values) if values else math.nan


def added(rounds: list[dict[str, Any]], direct: list[dict[str, Any]], key: str) -> float:
    """The median over rounds of (this target's figure - the upstream's, same round)."""
    values = [r[key] - d[key] for r, d in zip(rounds, direct, strict=True)]
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def fmt(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def table(
    results: dict[tuple[str, int], list[dict[str, Any]]], names: list[str], same_schedule: bool
) -> str:
    """The figures by C and target; ``same_schedule``: native delivery's replies are timed as
    the upstream's, so its added time to the first chunk is measured too."""
    head = (
        f"{'C':>5} {'target':<12}{'done':>10}{'TTFT p50':>10}{'+p50':>9}{'TTFT p99':>10}"
        f"{'+p99':>9}{'gap p99':>9}{'CPU µs':>8}{'KiB':>7}"
    )
    lines = [
        head,
        f"{'':>5} {'':<12}{'':>10}{'ms':>10}{'ms':>9}{'ms':>10}{'ms':>9}"
        f"{'+ms':>9}{'/chunk':>8}{'/strm':>7}",
    ]
    for streams in sorted({c for _, c in results}):
        direct = results[("upstream", streams)]
        for name in names:
            rounds = results.get((name, streams))
            if not rounds:
                continue
            done = statistics.median(r["completed"] for r in rounds)
            # Native delivery makes its own first token: comparable only on the same schedule.
            relayed = name != "upstream" and (name != "native" or same_schedule)
            plus50 = added(rounds, direct, "first_p50_ms") if relayed else math.nan
            plus99 = added(rounds, direct, "first_p99_ms") if relayed else math.nan
            memory = median(rounds, "kib_per_stream") if streams >= 100 else math.nan
            total = rounds[0]["streams"]
            lines.append(
                f"{streams:>5} {name:<12}{f'{done:g}/{total}':>10}"
                f"{fmt(median(rounds, 'first_p50_ms'), '.2f'):>10}{fmt(plus50, '+.2f'):>9}"
                f"{fmt(median(rounds, 'first_p99_ms'), '.2f'):>10}{fmt(plus99, '+.2f'):>9}"
                f"{fmt(median(rounds, 'gap_p99_ms'), '.1f'):>9}"
                f"{fmt(median(rounds, 'cpu_us_per_chunk'), '.0f'):>8}{fmt(memory, '.0f'):>7}"
            )
    return "\n".join(lines)


def relay_context(
    name: str, upstream: str, tmp: Path, args: argparse.Namespace
) -> contextlib.AbstractAsyncContextManager[Target]:
    if name == "replystream":
        return replystream_relay(upstream, args.loop, args.workers)
    if name == "nginx":
        return nginx_relay(upstream, tmp)
    if name in ("pipe", "parse-pipe"):
        return pipe_relay(upstream, args.loop, parse=name == "parse-pipe")
    if name == "native":
        return native_server(
            args.chunks, args.interval_ms, args.loop, args.workers, args.first_chunk_ms
        )
    return litellm_relay(upstream, tmp, args.litellm)


async def main(args: argparse.Namespace) -> dict[tuple[str, int], list[dict[str, Any]]]:
    raise_nofile()
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    idle: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp_name:
        tmp = Path(tmp_name)
        async with (
            upstream_server(
                args.upstream_processes, args.chunks, args.interval_ms, args.first_chunk_ms
            ) as upstream,
            contextlib.AsyncExitStack() as stack,
        ):
            targets = [upstream]
            for name in args.relays:
                targets.append(
                    await stack.enter_async_context(relay_context(name, upstream.url, tmp, args))
                )
            for target in targets:  # warm-up: imports, pools, the first connections
                await run_client(
                    {"url": target.url, "streams": 5, "api_key": API_KEY, "timeout_s": 30}
                )
            # Rounds inside each C: a relay still busy after a saturated run at a high C
            # delays only the later rounds of that C.
            for streams in args.concurrency:
                for round_index in range(args.rounds):
                    for target in targets:
                        figures = await measure(target, streams, args, idle)
                        results.setdefault((target.name, streams), []).append(figures)
                        print(
                            f"round {round_index + 1} C={streams} {target.name}: "
                            f"{figures['completed']}/{figures['streams']} done, "
                            f"CPU {figures['cpu_us_per_chunk']:.0f} µs/chunk",
                            file=sys.stderr,
                            flush=True,
                        )
    busy = statistics.median(r["machine_busy_cores"] for rs in results.values() for r in rs)
    print(
        f"upstream: {args.chunks} chunks {args.interval_ms:g} ms apart per stream, the first "
        + (
            f"{args.first_chunk_ms:g} ms after the response head; "
            if args.first_chunk_ms
            else "with the response head; "
        )
        + (
            f"replystream on {args.workers} worker processes, each other relay on one"
            if args.workers > 1
            else "each relay on one process"
        )
        + f" (replystream --loop {args.loop}); medians of {args.rounds} round(s); "
        f"the whole machine busy {busy:.1f} cores during a run (median, ours included)"
    )
    same_schedule = args.first_chunk_ms >= args.interval_ms
    print(table(results, ["upstream", *args.relays], same_schedule))
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="C = 1 and 100, one round, where not given"
    )
    parser.add_argument(
        "-C", "--concurrency", type=int, nargs="+", help="streams at once (default 1 100 500 1000)"
    )
    parser.add_argument("--rounds", type=int, help="rounds of every C and target (default 3)")
    parser.add_argument("--relays", nargs="+", choices=RELAYS, default=list(RELAYS))
    parser.add_argument("--litellm", default=shutil.which("litellm"), help="litellm executable")
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="uvloop",  # serve's own where uvloop is installed (--loop auto)
        help="the event loop of replystream, native and the pipes",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes of replystream and of native (default 1)",
    )
    parser.add_argument("--chunks", type=int, default=CHUNKS)
    parser.add_argument("--interval-ms", type=float, default=INTERVAL_MS)
    parser.add_argument(
        "--first-chunk-ms",
        type=float,
        default=0.0,
        help="the upstream's time from its response head to its first chunk, as a model's "
        "prefill (default 0: the first chunk comes with the head)",
    )
    parser.add_argument("--upstream-processes", type=int, default=1)
    parser.add_argument(
        "--timeout-s", type=float, default=10.0, help="how long a run may last past the reply"
    )
    parser.add_argument(
        "--replies-per-slot", type=int, default=2, help="replies each of the C slots streams"
    )
    parser.add_argument(
        "--burst",
        action="store_true",
        help="start the C slots all at once (default: spread over one reply's length)",
    )
    parser.add_argument("--json", help="also write every round's figures to this file")
    args = parser.parse_args()
    # --quick fills in only the counts not given: a -C or --rounds given is what runs.
    if args.concurrency is None:
        args.concurrency = [1, 100] if args.quick else [1, 100, 500, 1000]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if "litellm" in args.relays and not args.litellm:
        parser.error(
            "--litellm: no litellm executable found (pip install -e '.[bench]', or give its path)"
        )
    if "litellm" in args.relays and not shutil.which(args.litellm):
        parser.error(f"--litellm: {args.litellm!r} is not an executable")
    if "nginx" in args.relays and nginx_binary() is None:
        parser.error("--relays nginx: nginx is not installed (or not on PATH)")
    if args.rounds < 1 or args.replies_per_slot < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --replies-per-slot and every -C must be at least 1")
    if args.workers < 1 or args.upstream_processes < 1 or args.chunks < 1:
        parser.error("--workers, --upstream-processes and --chunks must be at least 1")
    if args.interval_ms <= 0 or args.timeout_s <= 0:
        parser.error("--interval-ms and --timeout-s must be above 0")
    if args.first_chunk_ms < 0:
        parser.error("--first-chunk-ms must not be negative")
    if args.json is not None and not Path(args.json).parent.is_dir():
        parser.error(f"--json: no directory {str(Path(args.json).parent)!r} to write it in")
    return args


def cli() -> None:
    arguments = parse_args()
    write_bytecode()
    figures = asyncio.run(main(arguments))
    if arguments.json:
        Path(arguments.json).write_text(
            json.dumps({f"{n} C={c}": r for (n, c), r in figures.items()}, indent=1)
        )
    # In this process, once the servers are gone: it measures one core's own work.
    replies = 500 if arguments.quick else 2000
    print(parse_cost.report(parse_cost.measure(replies=replies, repeats=3)))


if __name__ == "__main__":
    tool_main(cli)
