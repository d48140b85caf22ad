"""Where a relayed reply's first token waits inside the relay, stage by stage, idle and under load.

The relay benchmark (``run.py``) measures the time a relay adds to the first token from the
client's side. This splits replystream's share of it at its own stages, with the stamps of
``stage_probe.py`` (a ``replystream serve --engine upstream:...`` whose functions on that way
are wrapped): the client's connection accepted, its request read, the handler started, the
request written upstream, the upstream's head read, the handler resumed with it, and the
first text written to the client. Two phases against the relay benchmark's upstream:

- ``idle``: one stream at a time (``--idle`` replies, one after another);
- ``loaded``: C streams open at once (``-C``), as ``run.py`` makes them (``relay_client.py``,
  the slots' starts spread over one reply's length, ``--replies-per-slot`` each).

For each step between two stages: its time (p50, p90) in each phase, and the turns of the
event loop it took (p50, loaded); for the handler's own work before the request goes
upstream, also the CPU time the process spent in it (p50). The relay's own share is every
step but ``sent -> head`` (the upstream's). The client-seen time to the first chunk of the
same requests is printed with it. ``--pin-relay CPU`` keeps the relay's process on one core
(``sched_setaffinity``), as ``taskset`` or systemd's ``CPUAffinity=`` would in a deployment.

Run: python benchmarks/relay/first_token_stages.py [-C 100] [--replies-per-slot 3] [--idle 15]
         [--pin-relay CPU]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the delivery benchmark's modules, and ours
    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "delivery")]

from procstats import raise_nofile

from relay.relays import API_KEY, upstream_server
from relay.run import run_client
from relay.stage_probe import STAGES
from relay.upstream_server import CHUNKS, INTERVAL_MS
from replystream.lab.local_server import READY, announced_process
from replystream.stats import percentile
from tool_main import tool_main

PROBE = Path(__file__).resolve().parent / "stage_probe.py"
STEPS = list(itertools.pairwise(STAGES))


def ms(rows: list[dict[str, float]], start: str, end: str, p: float) -> float:
    return percentile([(r[end] - r[start]) * 1000 for r in rows], p)


def turns(rows: list[dict[str, float]], start: str, end: str) -> float:
    return percentile([r["turn " + end] - r["turn " + start] for r in rows], 50)


def table(phases: dict[str, list[dict[str, float]]], first_ms: dict[str, float]) -> str:
    idle, loaded = phases["idle"], phases["loaded"]
    lines = [
        f"{'step':<22}{'idle p50':>10}{'p90':>8}{'loaded p50':>12}{'p90':>8}{'turns':>7}",
        f"{'':<22}{'ms':>10}{'ms':>8}{'ms':>12}{'ms':>8}{'p50':>7}",
    ]
    for start, end in STEPS:
        lines.append(
            f"{start + ' -> ' + end:<22}{ms(idle, start, end, 50):>10.3f}"
            f"{ms(idle, start, end, 90):>8.3f}{ms(loaded, start, end, 50):>12.3f}"
            f"{ms(loaded, start, end, 90):>8.3f}{turns(loaded, start, end):>7.0f}"
        )
    first, last = STAGES[0], STAGES[-1]
    lines.append(
        f"{first + ' -> ' + last:<22}{ms(idle, first, last, 50):>10.3f}"
        f"{ms(idle, first, last, 90):>8.3f}{ms(loaded, first, last, 50):>12.3f}"
        f"{ms(loaded, first, last, 90):>8.3f}{turns(loaded, first, last):>7.0f}"
    )
    own = {
        name: percentile(
            [(r["written"] - r["accepted"] - (r["head"] - r["sent"])) * 1000 for r in rows],
            50,
        )
        for name, rows in phases.items()
    }
    cpu = {
        name: percentile([(r["cpu sent"] - r["cpu handler"]) * 1000 for r in rows], 50)
        for name, rows in phases.items()
    }
    lines += [
        f"the relay's own share (all but sent -> head), p50: idle {own['idle']:.3f} ms, "
        f"loaded {own['loaded']:.3f} ms",
        f"CPU time of handler -> sent, p50: idle {cpu['idle']:.3f} ms, "
        f"loaded {cpu['loaded']:.3f} ms (the whole process's, over that step)",
        f"client-seen time to the first chunk, p50: idle {first_ms['idle']:.3f} ms, "
        f"loaded {first_ms['loaded']:.3f} ms",
        f"requests: idle {len(idle)}, loaded {len(loaded)}",
    ]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> str:
    raise_nofile()
    with tempfile.TemporaryDirectory(prefix="stages-") as tmp:
        out = Path(tmp) / "stamps"
        async with upstream_server(1, args.chunks, args.interval_ms) as upstream:
            command = [sys.executable, str(PROBE), str(out), "serve", "--host", "127.0.0.1"]
            command += ["--port", "0", "--engine", f"upstream:{upstream.url}/v1"]
            command += ["--upstream-model", "bench", "--model-name", "bench"]
            command += ["--log-level", "WARNING"]
            async with announced_process(command, READY, name="probed relay") as relay:
                if args.pin_relay is not None:  # the relay's process on that core only
                    os.sched_setaffinity(relay.pid, {args.pin_relay})
                batch = 0

                async def stamps() -> list[dict[str, float]]:
                    nonlocal batch
                    batch += 1
                    os.kill(relay.pid, signal.SIGUSR1)
                    path = out.with_suffix(f".{batch}")  # renamed into place once written
                    for _ in range(200):
                        if path.exists():
                            rows: list[dict[str, float]] = json.loads(path.read_text())
                            return rows
                        await asyncio.sleep(0.05)
                    raise RuntimeError("the probed relay wrote no stamps within 10 s")

                def config(streams: int, replies: int, spread_s: float) -> dict[str, Any]:
                    reply_s = args.chunks * args.interval_ms / 1000
                    return {
                        "url": relay.url,
                        "streams": streams,
                        "replies_per_slot": replies,
                        "spread_s": spread_s,
                        "api_key": API_KEY,
                        "timeout_s": spread_s + reply_s * replies + 30,
                    }

                await run_client(config(5, 1, 0.0))  # warm-up: imports, the first connections
                await stamps()
                idle = await run_client(config(1, args.idle, 0.0))
                phases = {"idle": await stamps()}
                reply_s = args.chunks * args.interval_ms / 1000
                loaded = await run_client(config(args.concurrency, args.replies_per_slot, reply_s))
                phases["loaded"] = await stamps()
    first_ms = {
        "idle": percentile(idle["first_s"], 50) * 1000,
        "loaded": percentile(loaded["first_s"], 50) * 1000,
    }
    for name, rows in phases.items():
        if not rows:
            raise RuntimeError(f"no request of the {name} phase was stamped")
    pinned = "" if args.pin_relay is None else f"; the relay on core {args.pin_relay} alone"
    head = (
        f"relayed chat completions, {args.chunks} chunks {args.interval_ms:g} ms apart; "
        f"idle: one at a time; loaded: C = {args.concurrency}{pinned}"
    )
    return head + "\n" + table(phases, first_ms)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-C", "--concurrency", type=int, default=100)
    parser.add_argument("--replies-per-slot", type=int, default=3)
    parser.add_argument("--idle", type=int, default=15, help="replies of the idle phase")
    parser.add_argument("--chunks", type=int, default=CHUNKS)
    parser.add_argument("--interval-ms", type=float, default=INTERVAL_MS)
    parser.add_argument(
        "--pin-relay", type=int, metavar="CPU", help="run the relay on this core alone"
    )
    arguments = parser.parse_args()
    for flag, value in (
        ("-C", arguments.concurrency),
        ("--replies-per-slot", arguments.replies_per_slot),
        ("--idle", arguments.idle),
        ("--chunks", arguments.chunks),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1")
    if arguments.interval_ms <= 0:
        parser.error("--interval-ms must be positive")
    if arguments.pin_relay is not None and arguments.pin_relay not in os.sched_getaffinity(0):
        parser.error(f"--pin-relay: core {arguments.pin_relay} is not one this process may use")
    print(asyncio.run(main(arguments)))


if __name__ == "__main__":
    tool_main(cli)
