"""Delivery load benchmark: replystream against a bare aiohttp handler and Starlette, side by side.

For each concurrency C and each server (and transport: SSE, or WebSocket for replystream and
the bare handler), a fresh server process streams C replies opened at once (120 tokens,
33 ± 8 ms each, one seed per stream, the same seeds for every server and transport) to a
load client in its own process. Measured: delivered events per second, completion against the
schedule's ideal, per-event lateness, first text, server CPU per 1,000 events and peak memory
per open stream (Linux /proc, summed over the server's processes), the peak number of streams
open at once, failures and the client's own CPU per event. See docs/performance.md.

With ``--servers replystream-redis replystream-redis-2``, every reply is resumable and logged in
a Redis the benchmark starts fresh for the run (one replica, or two behind nginx): the table
adds Redis's CPU per event, its memory per reply logged and nginx's CPU per event.

Run: python benchmarks/delivery/run.py [--concurrency 100 1000 3000]
         [--servers replystream bare starlette replystream-resumable replystream-redis
          replystream-redis-2] [--transports sse ws] [--workers N [N ...]]
         [--wait-quiet-s 20]
         [--timeout-s 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import time
from importlib import import_module, metadata
from pathlib import Path
from typing import Any

from bytecode import write_bytecode
from procstats import (
    cpu_seconds,
    listen_overflows,
    machine_busy_seconds,
    memory_kib,
    process_tree,
    raise_nofile,
)
from report import failure_notes, table
from servers import (
    DEFAULT_SERVERS,
    HERE,
    LOOPS,
    SERVER_NAMES,
    SERVER_PROGRAMS,
    SERVER_TRANSPORTS,
    TRANSPORTS,
    Started,
    Variant,
    check_wire,
    started_server,
)
from tier import find_binary
from workload import TOKENS, schedule, stream_seeds

from replystream.engine import GenerationRequest, SamplingParams, SimulatedConfig, SimulatedEngine
from replystream.lab.local_server import owned_child, stop_process

# The benchmarks' shared modules (tool_main), beside this folder's own.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tool_main import tool_main

WARMUP_STREAMS = 20
WARMUP_TOKENS = 5
SETTLE_S = 0.5
QUIET_CORES = 0.3


async def other_load(seconds: float = 1.0) -> float:
    """Cores busy on the whole machine over ``seconds`` (call it while the benchmark is idle)."""
    before = machine_busy_seconds()
    await asyncio.sleep(seconds)
    return (machine_busy_seconds() - before) / seconds


async def wait_quiet(limit_s: float) -> float:
    """Wait up to ``limit_s`` for other work on the machine to fall below QUIET_CORES."""
    load = await other_load()
    deadline = time.monotonic() + limit_s
    while load > QUIET_CORES and time.monotonic() < deadline:
        load = await other_load()
    return load


async def run_client(
    url: str, seeds: list[int], max_tokens: int | None, timeout_s: float, transport: str = "sse"
) -> Any:
    """Run the load client in its own process and return its measurements."""
    config = {
        "url": url,
        "transport": transport,
        "seeds": seeds,
        "max_tokens": max_tokens,
        "timeout_s": timeout_s,
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "loadclient.py"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        **owned_child(),
    )
    try:
        out, _ = await process.communicate(json.dumps(config).encode())
    finally:  # interrupted: the client is stopped with the run
        await stop_process(process)
    if process.returncode != 0:
        raise RuntimeError(f"load client failed with status {process.returncode}")
    return json.loads(out)


def server_pids(server: Started) -> list[int]:
    """Every process of the server's replicas (workers included)."""
    return [pid for root in server.replicas for pid in process_tree(root)]


async def measure(
    server: Started, transport: str, concurrency: int, timeout_s: float, quiet_s: float
) -> dict[str, Any]:
    """Warm the server up, then run C streams and read its CPU and memory around them (and
    those of its Redis and nginx, when it has them)."""
    await check_wire(server, transport)
    warm_seeds = stream_seeds(WARMUP_STREAMS, 1)
    warm = await run_client(server.url, warm_seeds, WARMUP_TOKENS, 30.0, transport)
    if warm["failed"]:
        raise RuntimeError(f"{server.name} failed its warm-up: {warm['failures']}")
    # Other work on the machine skews every number: wait for quiet, and measure it anyway.
    load_before = await wait_quiet(quiet_s) if quiet_s > 0 else await other_load(SETTLE_S)
    pids = server_pids(server)
    helpers = {"redis": server.redis.pid if server.redis else None, "proxy": server.proxy_pid}
    helper_cpu = {name: cpu_seconds([pid]) for name, pid in helpers.items() if pid is not None}
    redis_memory = await server.redis.used_memory() if server.redis else None
    rest_rss = memory_kib(pids, "VmRSS")
    cpu_before = cpu_seconds(pids)
    overflows_before = listen_overflows()
    busy_before = machine_busy_seconds()
    wall_before = time.perf_counter()
    client = await run_client(server.url, stream_seeds(concurrency), None, timeout_s, transport)
    wall = time.perf_counter() - wall_before
    busy = machine_busy_seconds() - busy_before
    overflows = listen_overflows() - overflows_before
    pids_after = server_pids(server)
    cpu = cpu_seconds(pids_after) - cpu_before
    peak = memory_kib(pids_after, "VmHWM")
    for name, pid in helpers.items():
        if pid is not None:
            helper_cpu[name] = cpu_seconds([pid]) - helper_cpu[name]
    if server.redis and redis_memory is not None:
        # Every reply's log is still in Redis (kept for the reply TTL after its end).
        redis_memory = await server.redis.used_memory() - redis_memory
    events = client["events"]
    peak_open = client["peak_open"]
    completed = client["completed"]
    redis_cpu, proxy_cpu = helper_cpu.get("redis"), helper_cpu.get("proxy")
    return {
        "concurrency": concurrency,
        "processes": len(pids_after),
        "other_cores_before": load_before,
        # Busy CPU on the machine not spent by the server (its Redis and nginx included) or
        # the load client, on average.
        "other_cores_during": max(
            0.0, busy - cpu - sum(helper_cpu.values()) - client["client_cpu_s"]
        )
        / wall,
        "listen_overflows": overflows,
        "client": client,
        "server_cpu_s": cpu,
        "server_cpu_s_per_1k_events": cpu / events * 1000 if events else math.nan,
        "server_us_per_event": cpu / events * 1e6 if events else math.nan,
        "redis_cpu_s": redis_cpu,
        "redis_us_per_event": redis_cpu / events * 1e6
        if redis_cpu is not None and events
        else math.nan,
        "proxy_cpu_s": proxy_cpu,
        "proxy_us_per_event": proxy_cpu / events * 1e6
        if proxy_cpu is not None and events
        else math.nan,
        "redis_memory_bytes": redis_memory,
        "redis_memory_per_reply_kib": redis_memory / 1024 / completed
        if redis_memory is not None and completed
        else math.nan,
        "rest_rss_kib": rest_rss,
        "peak_hwm_kib": peak,
        "memory_per_stream_kib": (peak - rest_rss) / concurrency,
        "memory_per_open_stream_kib": (peak - rest_rss) / peak_open if peak_open else math.nan,
    }


async def measure_variant(
    variant: Variant, concurrency: int, timeout_s: float, quiet_s: float, loop: str
) -> dict[str, Any]:
    """Start ``variant`` fresh, measure it at ``concurrency``, stop it; print a progress line."""
    async with started_server(variant.name, variant.workers, loop) as server:
        result = await measure(server, variant.transport, concurrency, timeout_s, quiet_s)
    result = {
        "server": variant.label,
        "name": variant.name,
        "transport": variant.transport,
        "workers": variant.workers,
        "loop": loop,
        **result,
    }
    client = result["client"]
    print(
        f"{variant.label:>21} C={concurrency:<5} completed {client['completed']}/{concurrency}"
        f"  {result['server_us_per_event']:.1f} µs CPU/event"
        f"  {result['memory_per_stream_kib']:.1f} KiB/stream"
        + (
            f"  Redis {result['redis_us_per_event']:.1f} µs CPU/event"
            if result["redis_cpu_s"] is not None
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    return result


async def quietest_run(variant: Variant, concurrency: int, args: argparse.Namespace) -> Any:
    """Measure ``variant``; repeat up to ``--rerun-if-busy`` times while others used the CPU."""
    best: dict[str, Any] | None = None
    for attempt in range(1 + args.rerun_if_busy):
        result = await measure_variant(
            variant, concurrency, args.timeout_s, args.wait_quiet_s, args.loop
        )
        result["attempt"] = attempt + 1
        if best is None or result["other_cores_during"] < best["other_cores_during"]:
            best = result
        if result["other_cores_during"] <= QUIET_CORES:
            break
    assert best is not None
    return best


def check_schedule(count: int) -> None:
    """The shared schedule must be the simulated engine's, seed for seed."""
    engine = SimulatedEngine(SimulatedConfig(delay_ms=33.0, jitter_ms=8.0))
    for seed in stream_seeds(count):
        ours = schedule(seed)
        theirs = engine.schedule(GenerationRequest(sampling=SamplingParams(seed=seed)))
        if len(ours) != TOKENS or ours != theirs:
            raise SystemExit(f"benchmark schedule differs from SimulatedEngine's for seed {seed}")


def strict_json(value: Any) -> Any:
    """``value`` with NaN (a metric with no samples) as null, which every JSON reader accepts."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [strict_json(item) for item in value]
    return value


def revision() -> str:
    """The checkout's commit, ``-dirty`` when the working tree has changes."""
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return described.stdout.strip()


# What the Starlette baseline (starlette_app.py) imports: the bench extra.
STARLETTE_MODULES = ("starlette", "sse_starlette", "uvicorn")


def not_importable(modules: tuple[str, ...]) -> list[str]:
    missing = []
    for module in modules:
        try:
            import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "replystream_revision": revision()}
    for package in (
        "replystream",
        "aiohttp",
        "starlette",
        "sse-starlette",
        "uvicorn",
        "httptools",
        "uvloop",
    ):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one line and before any server starts, what no run could measure."""
    if min(args.concurrency) < 1 or min(args.workers) < 1:
        parser.error("every --concurrency and --workers must be at least 1")
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be above 0")
    if args.wait_quiet_s < 0 or args.rerun_if_busy < 0:
        parser.error("--wait-quiet-s and --rerun-if-busy must not be negative")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json: no directory {str(args.json.parent)!r} to write it in")
    if not any(t in SERVER_TRANSPORTS[name] for name in args.servers for t in args.transports):
        parser.error(
            f"--transports {' '.join(args.transports)}: none of --servers"
            f" {' '.join(args.servers)} has it, nothing to measure"
        )
    if "starlette" in args.servers and (missing := not_importable(STARLETTE_MODULES)):
        parser.error(
            f"--servers starlette: {', '.join(missing)} not installed"
            " (pip install -e '.[bench]', or leave starlette out of --servers)"
        )
    for name in args.servers:
        for program in SERVER_PROGRAMS.get(name, ()):
            if find_binary(program) is None:
                parser.error(
                    f"--servers {name}: {program} is not installed"
                    " (or not on PATH); leave it out of --servers"
                )


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[100, 1000, 3000])
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=SERVER_NAMES,
        default=list(DEFAULT_SERVERS),
        help="replystream-resumable: every reply resumable, logged in memory;"
        " replystream-redis: the same, logged in Redis (started by the benchmark);"
        " replystream-redis-2: two such replicas behind nginx",
    )
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=TRANSPORTS,
        default=["sse"],
        help="sse: POST /v1/replies; ws: one reply per GET /v1/ws socket (replystream and bare)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1],
        help="replystream serve --workers N; several values measure each (1 2: one vs two)",
    )
    parser.add_argument(
        "--loop",
        choices=LOOPS,
        default="asyncio",
        help="the event loop of every server (uvicorn's too), so they are compared on the same",
    )
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per run, from the burst")
    parser.add_argument(
        "--wait-quiet-s",
        type=float,
        default=20.0,
        help=f"before each run, wait up to this long for other load below {QUIET_CORES} cores",
    )
    parser.add_argument(
        "--rerun-if-busy",
        type=int,
        default=0,
        metavar="N",
        help=f"repeat a run up to N times while other load was above {QUIET_CORES} cores;"
        " the table keeps the quietest",
    )
    parser.add_argument("--json", type=Path, help="write every measurement to this file")
    args = parser.parse_args()
    check_arguments(parser, args)
    nofile = raise_nofile()  # children inherit it
    check_schedule(max(args.concurrency))
    for name in args.servers:
        if missing := [t for t in args.transports if t not in SERVER_TRANSPORTS[name]]:
            kept = [t for t in args.transports if t in SERVER_TRANSPORTS[name]]
            scope = f"measured over {' and '.join(kept)} only" if kept else "not measured"
            print(f"{name} has no {' or '.join(missing)} variant: {scope}", file=sys.stderr)
    variants = [
        Variant(name, workers, transport)
        for transport in args.transports
        for name in args.servers
        if transport in SERVER_TRANSPORTS[name]
        for workers in (args.workers if name == "replystream" else [1])
    ]
    labels = [variant.label for variant in variants]
    runs: list[dict[str, Any]] = []
    fatal: str | None = None
    try:
        for concurrency in args.concurrency:
            for variant in variants:
                runs.append(await quietest_run(variant, concurrency, args))
    except RuntimeError as error:  # a server that did not start, died or wrote other bytes
        fatal = str(error)
    print(f"Every server on the {args.loop} event loop.\n")
    print(table(runs, labels, args.concurrency))
    notes = failure_notes(runs)
    if fatal is not None:
        notes.append(fatal)
    for run in runs:
        if run["client"]["client_us_per_event"] >= run["server_us_per_event"]:
            print(f"WARNING the load client cost more CPU per event than {run['server']}", end="")
            print(f" at C = {run['concurrency']}: its numbers measure the client too")
    for note in notes:
        print(f"FAILED {note}")
    if args.json:
        report = {
            "command": ["python", "benchmarks/delivery/run.py", *sys.argv[1:]],
            "machine": {"cpus": os.cpu_count(), "nofile": nofile, "platform": platform.platform()},
            "versions": versions(),
            "runs": runs,
            "failed": notes,
        }
        args.json.write_text(json.dumps(strict_json(report), indent=2, allow_nan=False) + "\n")
    return 1 if notes else 0


if __name__ == "__main__":
    write_bytecode()
    tool_main(lambda: asyncio.run(main()))
