"""``replystream lab``: run the stream-vs-wait experiment and report it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from replystream.client import ReplyTiming
from replystream.lab.experiment import MODES, LabConfig, LabRun, run_experiment
from replystream.lab.local_server import local_server
from replystream.lab.plots import plot_timeline


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = LabConfig()
    parser.add_argument("--url", help="measure this server instead of starting one locally")
    parser.add_argument("--calls", type=int, default=defaults.calls, help="calls per mode")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="tokens per reply")
    parser.add_argument("--delay-ms", type=float, default=defaults.delay_ms)
    parser.add_argument("--jitter-ms", type=float, default=defaults.jitter_ms)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--first-token-ms",
        type=float,
        default=defaults.first_token_ms,
        help="simulated queueing plus prefill before the first token",
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for timeline files")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


def render_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title="stream vs wait: when does text arrive? (client side, parsed text)")
    for column in (
        "Mode",
        "First text, median",
        "First text, p95",
        "Total, median",
        "Total, p95",
        "Complete",
    ):
        table.add_column(column, justify="left" if column == "Mode" else "right", no_wrap=True)
    names = {"wait": "Wait (buffered)", "stream": "Stream (SSE)"}
    for mode in MODES:
        row = result[mode]
        table.add_row(
            names[mode],
            _fmt(row["first_text_ms"]["median"]),
            _fmt(row["first_text_ms"]["p95"]),
            _fmt(row["total_ms"]["median"]),
            _fmt(row["total_ms"]["p95"]),
            f"{row['complete']}/{row['calls']}",
        )
    console.print(table)
    if result["first_text_sooner_ms"] is None:
        console.print("Some calls did not complete: no comparison is made.")
        return
    console.print(
        f"First text sooner by streaming: {result['first_text_sooner_ms']:,.1f} ms; "
        f"total medians differ by {result['total_median_diff_ms']:+,.1f} ms "
        f"({result['total_median_diff_pct']:+.2f} %)."
    )


async def _run(config: LabConfig, quiet: bool) -> LabRun:
    total = config.calls * len(MODES)
    with Progress(
        TextColumn("[bold]lab[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=quiet,
    ) as progress:
        task = progress.add_task("calls", total=total)

        def on_done(mode: str, timing: ReplyTiming) -> None:
            progress.advance(task)

        if config.url:
            return await run_experiment(config, config.url.rstrip("/"), on_done)
        async with local_server(config.server_args()) as url:
            return await run_experiment(config, url, on_done)


def run(args: argparse.Namespace) -> int:
    config = LabConfig(
        tokens=args.tokens,
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        seed=args.seed,
        first_token_ms=args.first_token_ms,
        calls=args.calls,
        url=args.url,
    )
    if config.calls < 1 or config.tokens < 1:
        print("replystream lab: --calls and --tokens must be at least 1", file=sys.stderr)
        return 2
    lab_run = asyncio.run(_run(config, quiet=args.json))
    result = lab_run.summary()
    if args.json:
        print(json.dumps(result))
    else:
        console = Console()
        console.width = max(console.width, 100)  # keep the table on one line per mode in logs
        render_table(result, console)
        args.out.mkdir(parents=True, exist_ok=True)
        timeline = lab_run.timeline()
        timeline_path = args.out / "timeline.json"
        timeline_path.write_text(json.dumps(timeline, indent=1) + "\n")
        plot_path = args.out / "timeline.png"
        plot_timeline(timeline, plot_path)
        console.print(f"Wrote {timeline_path} and {plot_path}.")
        print("RESULT " + json.dumps(result))
    complete = all(result[mode]["complete"] == result[mode]["calls"] for mode in MODES)
    return 0 if complete else 1
