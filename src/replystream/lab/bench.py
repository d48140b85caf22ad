"""``replystream bench URL``: load any streaming endpoint and report TTFT, TPOT, ITL and E2EL.

This file decides the command line and the order of work (run the load with a progress bar,
summarize, then print, write JSON and plots). Sending is ``load``, the definitions are
``benchstats``, the table is ``bench_report``, the plots are ``bench_plots``; this file must not
compute a metric itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replystream.cli_values import (
    http_url,
    non_negative_int,
    output_file,
    output_folder,
    positive_float,
    positive_int,
)
from replystream.lab.bench_plots import plot_all
from replystream.lab.bench_report import render
from replystream.lab.benchstats import SLO, summarize
from replystream.lab.load import LoadConfig, LoadRun, RequestRecord, run_load
from replystream.lab.report_console import report_console
from replystream.lab.served_model import ModelLookupError, served_model
from replystream.lab.workload import APIS, Lengths, detect_api


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        type=http_url,
        help="endpoint: .../stream, .../v1/replies or .../chat/completions",
    )
    parser.add_argument(
        "--api",
        choices=["auto", *APIS],
        default="auto",
        help="request shape (auto: from the URL path)",
    )
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument(
        "--concurrency", type=positive_int, help="closed loop: requests in flight (default 1)"
    )
    loop.add_argument("--rate", type=positive_float, help="open loop: mean arrivals per second")
    parser.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="open loop: gamma shape of the gaps (1: Poisson, <1 burstier, >1 more regular)",
    )
    parser.add_argument(
        "--requests", type=positive_int, help="requests to send (default 10 without --duration)"
    )
    parser.add_argument(
        "--duration", type=positive_float, help="stop sending new requests after S s"
    )
    parser.add_argument(
        "--prompt-words",
        default="0",
        help="prompt length in words: N, uniform:LO:HI or normal:MEAN:SD",
    )
    parser.add_argument(
        "--output-tokens",
        help="max_tokens per request: N, uniform:LO:HI or normal:MEAN:SD (default: server's)",
    )
    parser.add_argument(
        "--model",
        help="model name, openai API only (default: the one the server's /v1/models lists)",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seeds arrival times and lengths"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=300.0, help="per-request timeout, s"
    )
    parser.add_argument(
        "--slo",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="goodput bounds, e.g. ttft:200 tpot:50 (metrics: ttft, tpot, e2el)",
    )
    parser.add_argument(
        "--no-warmup", action="store_true", help="do not send one unrecorded request first"
    )
    parser.add_argument(
        "--json", type=output_file, metavar="FILE", help="write the full result here"
    )
    parser.add_argument("--plot", type=output_folder, metavar="DIR", help="write PNG plots here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(
    args: argparse.Namespace, model: str | None = None
) -> tuple[LoadConfig, tuple[SLO, ...]]:
    """The load and the SLOs the options ask for (``model``: the one the server lists, when
    ``--model`` named none); raises ValueError for bad values."""
    closed = 1 if args.concurrency is None else args.concurrency
    requests = args.requests
    if requests is None and args.duration is None:
        requests = 10
    api = detect_api(args.url) if args.api == "auto" else args.api
    if args.model is not None and api != "openai":
        raise ValueError(f"--model names the model of an OpenAI request; the {api} API has none")
    config = LoadConfig(
        url=args.url,
        api=api,
        concurrency=None if args.rate is not None else closed,
        rate=args.rate,
        burstiness=args.burstiness,
        requests=requests,
        duration_s=args.duration,
        prompt_words=Lengths.parse(args.prompt_words, minimum=0),
        output_tokens=Lengths.parse(args.output_tokens, minimum=1) if args.output_tokens else None,
        model=args.model or model or "default",
        seed=args.seed,
        timeout_s=args.timeout,
        warmup=not args.no_warmup,
    )
    return config, tuple(SLO.parse(text) for text in args.slo)


async def _run(config: LoadConfig, quiet: bool) -> LoadRun:
    total = config.requests
    with Progress(
        TextColumn("[bold]bench[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} not complete"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=quiet,
    ) as progress:
        task = progress.add_task("requests", total=total, failed=0)
        not_complete = 0

        def on_done(record: RequestRecord) -> None:
            nonlocal not_complete
            not_complete += not record.timing.complete
            progress.update(task, advance=1, failed=not_complete)

        return await run_load(config, on_done)


def run(args: argparse.Namespace) -> int:
    try:
        config, slos = config_from_args(args)
        if config.api == "openai" and args.model is None:
            config, slos = config_from_args(args, asyncio.run(served_model(args.url)))
    except ValueError as exc:
        print(f"replystream bench: {exc}", file=sys.stderr)
        return 2
    except ModelLookupError as exc:
        print(f"replystream bench: {exc}", file=sys.stderr)
        return 1
    load_run = asyncio.run(_run(config, quiet=args.quiet))
    summary: dict[str, Any] = summarize(load_run, slos)
    console = report_console()
    render(summary, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
        console.print(f"Wrote {args.json}.", highlight=False)
    if args.plot:
        paths = plot_all(summary, args.plot)
        console.print(f"Wrote {', '.join(str(p) for p in paths)}.", highlight=False)
    counts = summary["counts"]
    return 0 if counts["complete"] == counts["requests"] else 1
