"""``replystream lab-engine``'s command line: its flags, and which experiment reads each.

The experiments themselves (``lab.engine_lab``) need NumPy, the engine and matplotlib; they are
imported only once the command line is sound, so a mistake in it is one line at once. A flag an
experiment does not read is refused, never taken and ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from replystream.cli_values import non_negative_float, output_folder, positive_int
from replystream.lab.lab_engines import GGUF_SIZES, TINY_SIZES, parse_lab_engine

EXPERIMENTS = ("ttft", "step", "pool", "spec")
# Which experiments read each option (by its ``dest``): any other refuses it, so no flag is
# taken and ignored.
OPTION_USERS: dict[str, tuple[str, ...]] = {
    "lengths": ("ttft",),
    "batches": ("step",),
    "repeats": ("ttft", "step", "spec"),
    "tokens": ("step", "pool", "spec"),
    "requests": ("pool",),
    "small_blocks": ("pool",),
    "spec_tokens": ("spec",),
    "spec_ngram": ("spec",),
    "temperature": ("spec",),
}
POOL_DEFAULTS = {"requests": 16, "small_blocks": 40}
SPEC_DEFAULTS = {"spec_tokens": 4, "spec_ngram": 3}


def _lengths(text: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers >= 1 (argparse type)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"want whole numbers >= 1 separated by commas, got {text!r}"
        )
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", choices=EXPERIMENTS)
    parser.add_argument(
        "--engine",
        type=parse_lab_engine,
        default=None,
        help="tiny, smollm2 or gguf:PATH (default: the engine serve would serve)",
    )
    # A text default goes through the type too: the PNG is always written.
    parser.add_argument("--out", type=output_folder, default=".", help="folder for the PNG")
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        help="ttft: prompt lengths in tokens, e.g. 64,1024,4096 "
        f"(default: {_csv(TINY_SIZES.ttft_lengths)} tiny, {_csv(GGUF_SIZES.ttft_lengths)} GGUF)",
    )
    parser.add_argument(
        "--batches",
        type=_lengths,
        default=None,
        help=f"step: batch sizes (default: {_csv(TINY_SIZES.step_batches)})",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="ttft: runs per prompt length; step: rounds over the batch sizes; spec: runs per "
        f"prompt; medians are reported (default: {TINY_SIZES.repeats} tiny, "
        f"{GGUF_SIZES.repeats} GGUF)",
    )
    parser.add_argument(
        "--tokens",
        type=positive_int,
        default=None,
        help="step, pool, spec: tokens per reply "
        f"(default: {TINY_SIZES.tokens} tiny, {GGUF_SIZES.tokens} GGUF)",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help=f"pool: requests in the burst (default: {POOL_DEFAULTS['requests']})",
    )
    parser.add_argument(
        "--small-blocks",
        type=positive_int,
        default=None,
        help="pool: the small pool, in blocks; fewer than the pool that holds every request "
        f"(default: {POOL_DEFAULTS['small_blocks']})",
    )
    parser.add_argument(
        "--spec-tokens",
        type=positive_int,
        default=None,
        help=f"spec: draft tokens per step (default: {SPEC_DEFAULTS['spec_tokens']})",
    )
    parser.add_argument(
        "--spec-ngram",
        type=positive_int,
        default=None,
        help=f"spec: longest n-gram looked up (default: {SPEC_DEFAULTS['spec_ngram']})",
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        help="spec: 0 is greedy; above, seeded draws (default: 0)",
    )


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def _refuse(message: str) -> int:
    print(f"replystream lab-engine: {message}", file=sys.stderr)
    return 2


def _unused_option(args: argparse.Namespace) -> str | None:
    """The first option given that ``args.experiment`` does not read, said as a mistake."""
    for dest, users in OPTION_USERS.items():
        if getattr(args, dest) is not None and args.experiment not in users:
            flag = "--" + dest.replace("_", "-")
            return f"{flag}: the {args.experiment} experiment does not use it ({', '.join(users)})"
    return None


def run(args: argparse.Namespace) -> int:
    unused = _unused_option(args)
    if unused is not None:
        return _refuse(unused)
    # The experiments (NumPy, the engine, matplotlib: most of a second) load once the command
    # line is sound, so a mistake in it is told at once; no cycle is hidden here.
    from replystream.engine.base import RequestRejected
    from replystream.engine.kv_cache import PoolTooLarge
    from replystream.lab import engine_lab as lab_runs
    from replystream.lab import spec_lab
    from replystream.lab.lab_engines import load_lab_engine
    from replystream.lab.report_console import report_console

    console = report_console()
    try:
        lab = load_lab_engine(args.engine, time.perf_counter)
    except (ValueError, OSError) as exc:
        return _refuse(f"--engine: {exc}")
    sizes = lab.sizes
    repeats = args.repeats or sizes.repeats
    tokens = args.tokens or sizes.tokens
    if args.experiment == "step" and tokens < 2:
        return _refuse(
            "--tokens: the step experiment times the gaps between tokens; give 2 or more"
        )
    room = lab_runs.reply_room(lab, args.experiment) if args.experiment != "ttft" else tokens
    if tokens > room:
        return _refuse(
            f"--tokens: {tokens} tokens do not fit after the {args.experiment} experiment's "
            f"prompt in the {lab.name} model's context of {lab.context}; give at most {room}"
        )
    console.print(f"engine: {lab.name} (loaded in {lab.load_seconds:.1f} s)")
    if args.experiment == "ttft":
        lengths = args.lengths or sizes.ttft_lengths
        too_long = [n for n in lengths if n >= lab.context]
        if too_long:
            return _refuse(
                f"--lengths: {too_long[0]} tokens leave no room for a reply in the {lab.name} "
                f"model's context of {lab.context}; give at most {lab.context - 1}"
            )
        rows = asyncio.run(lab_runs.run_ttft(lab, lengths, repeats))
        path = lab_runs.report_ttft(rows, args.out, console, lab.name)
    elif args.experiment == "step":
        batches = args.batches or sizes.step_batches
        try:
            step_rows = asyncio.run(lab_runs.run_step(lab, batches, tokens, repeats))
        except PoolTooLarge as exc:
            return _refuse(f"--batches: a batch of {max(batches)}: {exc}")
        path = lab_runs.report_step(step_rows, args.out, console, lab.name)
    elif args.experiment == "pool":
        requests = args.requests or POOL_DEFAULTS["requests"]
        small_blocks = args.small_blocks or POOL_DEFAULTS["small_blocks"]
        holds_all = lab_runs.pool_holding_all(lab, requests, tokens)
        if small_blocks >= holds_all:
            return _refuse(
                f"--small-blocks {small_blocks}: the pool that holds all {requests} requests "
                f"has {holds_all} blocks; give fewer"
            )
        try:
            runs = asyncio.run(lab_runs.run_pool(lab, requests, tokens, small_blocks))
        except PoolTooLarge as exc:
            return _refuse(f"--requests: {requests} requests at once: {exc}")
        except RequestRejected as exc:  # the small pool cannot hold even one request
            return _refuse(f"--small-blocks {small_blocks}: {exc}")
        path = lab_runs.report_pool(runs, args.out, console, lab.name)
    else:
        temperature = args.temperature or 0.0
        spec = spec_lab.run_spec(
            lab,
            tokens,
            repeats,
            args.spec_tokens or SPEC_DEFAULTS["spec_tokens"],
            args.spec_ngram or SPEC_DEFAULTS["spec_ngram"],
            temperature,
        )
        path = spec_lab.report_spec(asyncio.run(spec), args.out, console, temperature, lab.name)
    console.print(f"wrote {path}")
    return 0
