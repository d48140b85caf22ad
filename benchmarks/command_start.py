"""What a command costs before it does its work: how long a mistake on its command line takes
to be told, and how long (and how much CPU and memory) ``serve`` takes to be ready.

A command line's mistake is told by a fresh process (``python -m replystream ...``) that exits
with status 2; the time is the whole process's, start to exit, so the interpreter's own start
is in every figure: ``python -c pass`` is measured beside them as the floor. A server's start is
``serve --port 0`` until it prints its ready line, then its CPU (user + system, /proc) and
resident memory at that moment: the simulated engine, and a relay (``--engine upstream:URL``,
whose upstream is not reached before a request comes). ``--src LABEL=PATH`` (repeatable) runs
every command from each source tree (``PYTHONPATH=PATH``), interleaved run by run, so two
versions are compared under the same noise. Reported per case and source: the median over
``-N`` runs of each, and each source against the first.

Run: python benchmarks/command_start.py [-N 7] [--src before=/path/src --src after=/path/src]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the delivery benchmark's /proc readers
    sys.path.insert(0, str(Path(__file__).resolve().parent / "delivery"))

from procstats import cpu_seconds, memory_kib

from source_trees import source_trees
from tool_main import tool_main

SIMULATED = ["--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "0"]
# Each mistake: a case name, and the command line after ``python -m replystream``.
MISTAKES: list[tuple[str, list[str]]] = [
    ("serve: a flag it does not have", ["serve", "--no-such-flag"]),
    (
        "serve: values that contradict each other",
        ["serve", "--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "5"],
    ),
    ("bench: a flag it does not have", ["bench", "--no-such-flag"]),
    ("lab: a flag it does not have", ["lab", "--no-such-flag"]),
    ("doctor: a flag it does not have", ["doctor", "--no-such-flag"]),
    ("lab-engine: a flag it does not have", ["lab-engine", "--no-such-flag"]),
    (
        "lab-engine: a flag its experiment does not read (found after parsing)",
        ["lab-engine", "pool", "--engine", "tiny", "--repeats", "5"],
    ),
]
FLOOR = "python -c pass (the interpreter alone)"
# Each server: its name in the table, and its engine's flags.
SERVERS: list[tuple[str, list[str]]] = [
    ("serve --engine simulated", SIMULATED),
    ("serve --engine upstream:URL", ["--engine", "upstream:http://127.0.0.1:9/v1"]),
]
READY = ": to its ready line"
CPU = ": CPU at ready"
RSS = ": resident memory at ready (MiB)"


def environment(src: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    return env


def told(src: str | None, argv: list[str]) -> float:
    """Seconds from start to exit of ``python -m replystream ARGV``, which must refuse it."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "replystream", *argv],
        capture_output=True,
        env=environment(src),
        timeout=120,
    )
    took = time.perf_counter() - began
    if done.returncode != 2:
        raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}, not 2: {done.stderr!r}")
    return took


def interpreter(src: str | None) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=environment(src), check=True)
    return time.perf_counter() - began


def server_start(src: str | None, engine: list[str]) -> tuple[float, float, float]:
    """Seconds to the ready line of a server of ``engine``, and its CPU seconds and MiB then."""
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "replystream", "serve", "--port", "0", *engine],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=environment(src),
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        took = time.perf_counter() - began
        if not line.startswith(b"replystream listening on "):
            raise SystemExit(f"serve did not say it was ready: {line!r}")
        cpu, rss = cpu_seconds([process.pid]), memory_kib([process.pid], "VmRSS") / 1024
    finally:
        process.terminate()
        process.wait(30)
    return took, cpu, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-N", "--runs", type=int, default=7, help="runs of each case per source")
    parser.add_argument(
        "--src",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a source tree to run replystream from (repeatable; default: the installed one)",
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("argument -N/--runs: want a whole number >= 1")
    sources: list[tuple[str, str | None]] = [*source_trees(parser, args.src)]
    if not sources:
        sources = [("installed", None)]
    started = [name + what for name, _ in SERVERS for what in (READY, CPU, RSS)]
    cases = [FLOOR, *(name for name, _ in MISTAKES), *started]
    figures: dict[tuple[str, str], list[float]] = {(c, s): [] for c in cases for s, _ in sources}
    for _ in range(args.runs):
        for label, src in sources:  # interleaved: each source sees the same noise
            figures[FLOOR, label].append(interpreter(src))
            for name, argv in MISTAKES:
                figures[name, label].append(told(src, argv))
            for name, engine in SERVERS:
                took, cpu, rss = server_start(src, engine)
                figures[name + READY, label].append(took)
                figures[name + CPU, label].append(cpu)
                figures[name + RSS, label].append(rss)
    labels = [label for label, _ in sources]
    width = max(len(c) for c in cases)
    print(f"medians of {args.runs} runs; seconds unless said")
    header = "".join(f"{label:>12}" for label in labels)
    against = f"{labels[-1]}/{labels[0]}" if len(labels) > 1 else ""
    print(f"{'case':<{width}}{header}{against:>16}")
    for case in cases:
        medians = [statistics.median(figures[case, label]) for label in labels]
        row = "".join(f"{m:>12.1f}" if case.endswith(RSS) else f"{m:>12.3f}" for m in medians)
        ratio = f"{medians[-1] / medians[0]:>15.2f}x" if len(labels) > 1 and medians[0] else ""
        print(f"{case:<{width}}{row}{ratio}")


if __name__ == "__main__":
    tool_main(main)
