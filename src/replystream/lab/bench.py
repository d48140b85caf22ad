"""``replystream bench URL``: load any streaming endpoint and report TTFT, TPOT, ITL and E2EL.

This file decides the order of work: run the load, or a sweep of loads, with a progress bar;
summarize; then print, write JSON, CSV and plots. The flags are ``bench_args``, which of them
fit together and the configs they make ``bench_config``, sending is ``load`` (a run's config
and records: ``load_types``), pacing is ``profiles``, the sweep's order is ``sweep``, the
definitions are ``benchstats``, the table is ``bench_report``, the plots are ``bench_plots``;
this file must not compute a metric itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import TextColumn

from replystream.lab.bench_args import add_arguments as add_arguments
from replystream.lab.bench_compare import render_compare
from replystream.lab.bench_config import config_from_args
from replystream.lab.bench_csv import write_csv
from replystream.lab.bench_report import render, render_sweep
from replystream.lab.benchstats import summarize
from replystream.lab.ctrl_c import on_ctrl_c
from replystream.lab.load import run_load
from replystream.lab.load_types import LoadConfig, LoadRun, RequestRecord
from replystream.lab.progress_bar import progress_bar
from replystream.lab.report_console import report_console
from replystream.lab.served_model import ModelLookupError, served_model
from replystream.lab.sweep import RunNotMade, SweepConfig, run_sweep
from replystream.lab.whole_file import write_text_whole
from replystream.lab.workload import MODEL_APIS

# 128 + SIGINT, as a shell reports a process Ctrl-C stopped (cli.INTERRUPTED_EXIT: nothing
# here imports the command line's entry point).
INTERRUPTED_EXIT = 130


class Unreachable(RunNotMade):
    """The run's first request could not connect: nothing was measured (one line). A sweep's
    later run ends the sweep there instead, reporting the runs before it."""


class Interrupted(Exception):
    """Ctrl-C stopped a run before any request ended, or a sweep in its first run (one
    line)."""


class SweepInterrupted(Interrupted, RunNotMade):
    """Ctrl-C stopped one of a sweep's runs: the sweep ends there, with the runs before it
    (or, in its first, nothing measured: one line)."""

    def __init__(self) -> None:
        reason = "interrupted (Ctrl-C) in the sweep's first run: nothing was measured"
        super().__init__(reason, what="was interrupted (Ctrl-C): the sweep ends there")


async def _run(config: LoadConfig, quiet: bool, interrupt: asyncio.Event) -> LoadRun:
    # The bar counts requests; --requests counts conversations of up to --turns requests each
    # (a dataset's conversation may end sooner, leaving the bar short of full).
    total = None if config.requests is None else config.requests * config.turns
    with progress_bar(
        f"[bold]bench[/] {config.profile.kind}",
        TextColumn("{task.fields[failed]} not complete"),
        quiet=quiet,
    ) as progress:
        task = progress.add_task("requests", total=total, failed=0)
        not_complete = 0

        def on_done(record: RequestRecord) -> None:
            nonlocal not_complete
            not_complete += not record.timing.complete
            progress.update(task, advance=1, failed=not_complete)

        run = await run_load(config, on_done, interrupt=interrupt)
    if run.unreachable is not None:
        raise Unreachable(run.unreachable)
    if run.interrupted and not run.records:
        raise Interrupted("interrupted before any request ended: nothing was measured")
    return run


async def _sweep(
    config: LoadConfig, sweep: SweepConfig, quiet: bool
) -> tuple[dict[str, Any], bool]:
    """The sweep's result, and whether Ctrl-C ended it (its runs before that reported)."""

    async def one(interrupt: asyncio.Event) -> tuple[dict[str, Any], bool]:
        async def step(step_config: LoadConfig) -> LoadRun:
            try:
                run = await _run(step_config, quiet, interrupt)
            except Interrupted:  # before any of its requests ended
                raise SweepInterrupted() from None
            if run.interrupted:
                # A run cut short is not a run at its rate: the sweep ends before it.
                raise SweepInterrupted()
            return run

        return await run_sweep(config, sweep, step), interrupt.is_set()

    return await on_ctrl_c(one)


def run(args: argparse.Namespace) -> int:
    if args.compare is not None:
        return _compare(args)
    if args.url is None:
        print(
            "replystream bench: give the endpoint URL (or --compare A.json B.json)", file=sys.stderr
        )
        return 2
    try:
        config, sweep = config_from_args(args)
        if config.api in MODEL_APIS and args.model is None:
            listed = served_model(
                args.url, timeout_s=args.timeout, headers=args.header, tls=config.tls
            )
            config, sweep = config_from_args(args, asyncio.run(listed))
    except ValueError as exc:
        print(f"replystream bench: {exc}", file=sys.stderr)
        return 2
    except ModelLookupError as exc:
        print(f"replystream bench: {exc}", file=sys.stderr)
        return 1
    console = report_console()
    try:
        if args.profile == "sweep":
            result, interrupted = asyncio.run(_sweep(config, sweep, args.quiet))
        else:
            load_run = asyncio.run(on_ctrl_c(lambda stop: _run(config, args.quiet, stop)))
    except Interrupted as exc:
        print(f"replystream bench: {exc}", file=sys.stderr)
        return INTERRUPTED_EXIT
    except Unreachable as exc:
        # As a load tool's first test request does: a server that is not there is said once,
        # not counted as thousands of failed requests.
        print(
            f"replystream bench: {exc}; the run stopped at its first request, so nothing "
            "was measured",
            file=sys.stderr,
        )
        return 1
    if args.profile == "sweep":
        render_sweep(result, console)
        code = 0 if result["sweep"]["knee_rate"] is not None else 1
        if interrupted:
            code = INTERRUPTED_EXIT
    else:
        result = summarize(
            load_run,
            sweep.slos,
            warmup_s=sweep.warmup_s,
            slo_share=sweep.slo_share,
            steady_bound=sweep.steady_bound,
        )
        counts = result["counts"]
        if counts["warmup_requests"] and not counts["requests"]:
            # A run that ended inside its own warm-up window measured nothing: no table of
            # dashes with exit status 0.
            print(
                f"replystream bench: --warmup-s {sweep.warmup_s:g}: all "
                f"{counts['warmup_requests']} requests were sent within it (the run lasted "
                f"{load_run.wall_s:.2f} s), so none was measured; lower --warmup-s or send "
                "more --requests",
                file=sys.stderr,
            )
            return 2
        render(result, console)
        counts = result["counts"]
        code = 0 if counts["complete"] + counts["cancelled"] == counts["requests"] else 1
        if load_run.interrupted:
            code = INTERRUPTED_EXIT
    writes: list[tuple[str, Path | None, Callable[[Path], list[Path]]]] = [
        ("--json", args.json, lambda path: _write_json(result, path)),
        ("--csv", args.csv, lambda path: _write_csv(result, path)),
        ("--plot", args.plot, lambda folder: _plot(result, folder, args.profile == "sweep")),
    ]
    for flag, path, write in writes:
        if path is None:
            continue
        # The run is over and its table printed: a file that cannot be written (a full disk,
        # a file only root's open accepts) is said in one line, and the other outputs written.
        try:
            written = write(path)
        except KeyboardInterrupt:  # a second Ctrl-C while writing: the rest is left unwritten
            print(f"replystream bench: {flag} {path}: not written (Ctrl-C)", file=sys.stderr)
            return INTERRUPTED_EXIT
        except OSError as exc:
            print(f"replystream bench: {flag} {path}: {exc.strerror or exc}", file=sys.stderr)
            code = 1
            continue
        console.print(f"Wrote {', '.join(str(p) for p in written)}.", highlight=False, markup=False)
    return code


def _plot(result: dict[str, Any], folder: Path, sweep: bool) -> list[Path]:
    """The run's plots (``bench_plots``), in ``folder``. matplotlib takes half a second to
    load: only a run that plots loads it."""
    from replystream.lab import bench_plots

    return (bench_plots.plot_sweep if sweep else bench_plots.plot_all)(result, folder)


def _write_json(result: dict[str, Any], path: Path) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(path, json.dumps(result, indent=1) + "\n")
    return [path]


def _write_csv(result: dict[str, Any], path: Path) -> list[Path]:
    write_csv(result, path)
    return [path]


def _compare(args: argparse.Namespace) -> int:
    if args.url is not None:
        print(
            "replystream bench: --compare reads two files and sends nothing: drop the URL",
            file=sys.stderr,
        )
        return 2
    unused = _set_besides_compare(args)
    if unused is not None:
        print(f"replystream bench: {unused}: --compare only prints two results", file=sys.stderr)
        return 2
    try:
        render_compare(args.compare, report_console())
    except ValueError as exc:
        print(f"replystream bench: --compare: {exc}", file=sys.stderr)
        return 2
    return 0


def _set_besides_compare(args: argparse.Namespace) -> str | None:
    """The first option given a value other than its default, besides ``--compare``: none is
    read when comparing, so one given would be ignored (an output file never written)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    for action in parser._actions:  # argparse's table of options: no public way to walk it
        if action.option_strings and action.dest != "compare":
            if getattr(args, action.dest, action.default) != action.default:
                return action.option_strings[-1]
    return None
