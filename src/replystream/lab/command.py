"""``replystream lab``: run the stream-vs-wait experiment and report it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console
from rich.table import Table

from replystream.cli_values import (
    folder_problem,
    http_url,
    int_between,
    non_negative_int,
    output_folder,
    positive_float,
    positive_int,
    schedule_ms,
)
from replystream.client import ReplyTiming
from replystream.client.transport import ConnectError, TransportError
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.engine.seeds import MAX_SEED
from replystream.lab.client_options import add_header_argument
from replystream.lab.ctrl_c import on_ctrl_c
from replystream.lab.experiment import MODES, Interrupted, LabConfig, LabRun, run_experiment
from replystream.lab.local_server import local_server
from replystream.lab.open_files import OWN_FILES, make_room
from replystream.lab.progress_bar import progress_bar
from replystream.lab.report_console import report_console
from replystream.lab.whole_file import write_text_whole

# What the lab writes in --out: the first call's arrivals, and their plot.
TIMELINE_FILES = ("timeline.json", "timeline.png")

# 128 + SIGINT, as a shell reports a process Ctrl-C stopped (cli.INTERRUPTED_EXIT: nothing
# here imports the command line's entry point).
INTERRUPTED_EXIT = 130

# The paths of the modes, which the lab adds to --url itself.
MODE_PATHS = tuple(f"/{mode}" for mode in MODES)

# The local server's schedule: a server measured with --url keeps its own.
SCHEDULE_FLAGS = {
    "delay_ms": "--delay-ms",
    "jitter_ms": "--jitter-ms",
    "first_token_ms": "--first-token-ms",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = LabConfig()
    parser.add_argument(
        "--url",
        type=http_url,
        help="measure this replystream server (its /wait and /stream) instead of starting one",
    )
    parser.add_argument("--calls", type=positive_int, default=defaults.calls, help="calls per mode")
    parser.add_argument(
        "--tokens",
        # The local server builds its reply whole before it listens, and a server asked for
        # more than this refuses every call: a larger count is a mistake either way.
        type=int_between(1, MAX_TOKENS_LIMIT),
        help=f"tokens per reply, sent as max_tokens, at most {MAX_TOKENS_LIMIT:,} (default: "
        f"{defaults.tokens} locally; with --url, the server's reply length)",
    )
    schedule = "local server's schedule; not with --url, whose server keeps its own"
    parser.add_argument(
        "--delay-ms",
        type=schedule_ms,
        help=f"mean time per token (default: {defaults.delay_ms:g}; the {schedule})",
    )
    parser.add_argument(
        "--jitter-ms",
        type=schedule_ms,
        help=f"a token's delay varies by up to this, at most --delay-ms "
        f"(default: {defaults.jitter_ms:g}; the {schedule})",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=defaults.seed,
        help="call i of each mode asks for seed + i, so both modes get the same schedules",
    )
    parser.add_argument(
        "--first-token-ms",
        type=schedule_ms,
        help=f"queueing plus prefill before the first token "
        f"(default: {defaults.first_token_ms:g}; the {schedule})",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=defaults.timeout_s,
        help="a call not ended by then is incomplete; a warm-up call that is stops the run, s",
    )
    add_header_argument(
        parser,
        "a header sent with every call (repeatable): 'Authorization: Bearer KEY' for a server "
        "with API keys, which its /wait and /stream need",
    )
    parser.add_argument(
        "--out",
        type=output_folder,
        help="folder for timeline files (default: here, or none with --json)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print only the JSON result (and write the timeline files only with --out)",
    )


def config_from_args(args: argparse.Namespace) -> LabConfig:
    """The experiment the options ask for.

    Raises:
        ValueError: one line naming the flag: a schedule option with --url (it would not be
            applied), or a jitter larger than the delay.
    """
    defaults = LabConfig()
    if args.seed + args.calls - 1 > MAX_SEED:
        # Call i asks for seed + i: the last call's seed must be one the API takes.
        raise ValueError(
            f"--seed {args.seed}: call i asks for seed + i, and {args.calls} calls need a "
            f"seed of at most {MAX_SEED - args.calls + 1}"
        )
    if args.url is not None:
        parts = urlsplit(args.url)
        if parts.query or parts.fragment or args.url.endswith(("?", "#")):
            # The lab adds /wait?... and /stream?... to the URL: a query or fragment would
            # end up before those paths, so no call would reach them.
            raise ValueError(
                f"--url {args.url}: the lab adds its own paths and queries; give the server's "
                "address (and any path prefix) without a query or fragment"
            )
        if parts.path.rstrip("/").endswith(MODE_PATHS):
            # The lab adds /wait and /stream itself: one given here would be asked for twice.
            raise ValueError(
                f"--url {args.url}: give the server's address (and any path prefix); the lab "
                "adds /wait and /stream itself"
            )
        for dest, flag in SCHEDULE_FLAGS.items():
            if getattr(args, dest) is not None:
                raise ValueError(
                    f"{flag} sets the schedule of the server the lab starts; the server at "
                    f"--url keeps its own: drop {flag} (or start that server with it)"
                )
        return LabConfig(
            tokens=args.tokens,
            delay_ms=None,
            jitter_ms=None,
            first_token_ms=None,
            seed=args.seed,
            calls=args.calls,
            url=args.url.rstrip("/"),
            timeout_s=args.timeout,
            headers=tuple(args.header),
        )
    delay = defaults.delay_ms if args.delay_ms is None else args.delay_ms
    assert delay is not None and defaults.jitter_ms is not None
    # Not given, the default jitter is lowered to a shorter delay (a delay cannot be negative).
    jitter = min(defaults.jitter_ms, delay) if args.jitter_ms is None else args.jitter_ms
    if jitter > delay:
        raise ValueError(
            f"--jitter-ms {jitter:g} is more than --delay-ms {delay:g}: a token's delay "
            "cannot be negative; lower --jitter-ms"
        )
    return LabConfig(
        tokens=defaults.tokens if args.tokens is None else args.tokens,
        delay_ms=delay,
        jitter_ms=jitter,
        seed=args.seed,
        first_token_ms=(
            defaults.first_token_ms if args.first_token_ms is None else args.first_token_ms
        ),
        calls=args.calls,
        timeout_s=args.timeout,
        headers=tuple(args.header),
    )


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
    if result["interrupted"]:
        console.print(
            "Interrupted (Ctrl-C): the calls under way were cut, and count as incomplete; "
            "the figures are of the calls that had ended.",
            highlight=False,
        )
    for mode in MODES:
        row = result[mode]
        if row["complete"] < row["calls"]:
            console.print(
                f"{names[mode]}: {row['calls'] - row['complete']} of {row['calls']} calls did "
                f"not complete: {'; '.join(row['errors'])}",
                highlight=False,
                markup=False,  # a server's words, not Rich markup
                soft_wrap=True,  # one line, however long the reasons
            )
    if result["first_text_sooner_ms"] is None:
        console.print("No call completed in both modes: no comparison is made.")
        return
    compared = result["compared_calls"]
    calls = result["wait"]["calls"]
    over = "" if compared == calls else f" (over the {compared} of {calls} calls complete in both)"
    console.print(
        f"First text sooner by streaming: {result['first_text_sooner_ms']:,.1f} ms; "
        f"total medians differ by {result['total_median_diff_ms']:+,.1f} ms "
        f"({result['total_median_diff_pct']:+.2f} %){over}."
    )


async def _run(config: LabConfig, quiet: bool, interrupt: asyncio.Event) -> LabRun:
    total = config.calls * len(MODES)
    with progress_bar("[bold]lab[/]", quiet=quiet) as progress:
        task = progress.add_task("calls", total=total)

        def on_done(mode: str, timing: ReplyTiming) -> None:
            progress.advance(task)

        if config.url:
            return await run_experiment(config, config.url, on_done, interrupt)
        async with local_server(config.server_args(), interrupt=interrupt) as url:
            return await run_experiment(config, url, on_done, interrupt)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"replystream lab: {exc}", file=sys.stderr)
        return 2
    # The default folder (here) is not checked while parsing; --json alone writes no files.
    out = args.out if args.out is not None or args.json else Path(".")
    problem = None if out is None else folder_problem(out)
    if problem is None and out is not None:
        # A folder where a file goes would be found only after the run, by a traceback.
        folders = [out / name for name in TIMELINE_FILES if (out / name).is_dir()]
        problem = f"{folders[0]} is a folder where the lab writes a file" if folders else None
    if problem is not None:
        print(f"replystream lab: --out {out}: {problem}", file=sys.stderr)
        return 2
    # Every call of both modes holds its connection at once (and so does a local server,
    # which inherits the limit): room for them is made, or the run refused, before it starts.
    limit = make_room(len(MODES) * config.calls)
    if limit is not None:
        print(
            f"replystream lab: --calls {config.calls}: {len(MODES)} x {config.calls:,} calls "
            f"at once would each hold a connection, and this process may open {limit:,} files "
            f"(ulimit -Hn), {OWN_FILES} of them for itself; lower it, or raise the limit",
            file=sys.stderr,
        )
        return 2
    try:
        lab_run = asyncio.run(on_ctrl_c(lambda stop: _run(config, args.json, stop)))
    except Interrupted as exc:
        print(f"replystream lab: {exc}", file=sys.stderr)
        return INTERRUPTED_EXIT
    except TransportError as exc:
        # Only a refused connection says nothing listens there; any other failure (no file
        # left for a socket, a reset) is said as it is.
        refused = isinstance(exc, ConnectError) and exc.refused
        hint = "; is the server running?" if refused else ""
        where = f"--url {config.url}: " if config.url else "the local server: "
        print(f"replystream lab: {where}{exc}{hint}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the local server did not start or died; a warm-up failed
        print(f"replystream lab: {exc}", file=sys.stderr)
        return 1
    result = lab_run.summary()
    wrote: str | None = None
    if out is not None:
        timeline = lab_run.timeline()
        timeline_path, plot_path = (out / name for name in TIMELINE_FILES)
        # matplotlib takes half a second to load: a command line's mistake is told without it.
        from replystream.lab.plots import plot_timeline

        try:  # checked before the run, but a disk can fill or a folder go in the meantime
            out.mkdir(parents=True, exist_ok=True)
            write_text_whole(timeline_path, json.dumps(timeline, indent=1) + "\n")
            plot_timeline(timeline, plot_path)
            wrote = f"Wrote {timeline_path} and {plot_path}."
        except OSError as exc:
            print(f"replystream lab: --out {out}: {exc.strerror or exc}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        console = report_console()
        render_table(result, console)
        if wrote is not None:
            console.print(wrote, markup=False)
        print("RESULT " + json.dumps(result))
    if lab_run.interrupted:
        return INTERRUPTED_EXIT
    if out is not None and wrote is None:
        return 1
    complete = all(result[mode]["complete"] == result[mode]["calls"] for mode in MODES)
    return 0 if complete else 1
