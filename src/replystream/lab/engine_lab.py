"""``replystream lab-engine ttft|step|pool|spec``: what prefill, batching, KV capacity cost.

Each experiment runs a built-in engine in this process (``--engine tiny``, ``smollm2`` or
``gguf:PATH``; by default the one ``serve`` would serve, ``lab.lab_engines``), prints a table and
writes a PNG (named after the model unless it is the tiny one):
- ttft: time to first token against prompt length (prefill grows with the prompt; prompts
  longer than the token budget are prefilled in chunks, one per step);
- step: time per decode step and tokens/s against the number of running sequences;
- pool: more requests than the KV pool holds at once, against a pool that holds them all:
  queueing grows time to first token, preemption shows as a stall inside a running stream;
- spec: prompt-lookup speculative decoding against plain decoding (``lab.spec_lab``).
Times are the engine's own timestamps (``TinyEngine.timings``), not client-side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend is chosen first, above
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from replystream.cli_values import int_between, non_negative_float, output_folder, positive_int
from replystream.engine.base import GenerationRequest, RequestRejected, SamplingParams
from replystream.engine.runner import RequestTimings
from replystream.engine.tiny import TinyEngine
from replystream.lab.lab_engines import (
    GGUF_SIZES,
    TINY_SIZES,
    LabEngine,
    load_lab_engine,
    parse_lab_engine,
    plot_name,
)
from replystream.lab.report_console import report_console
from replystream.lab.spec_lab import report_spec, run_spec

EXPERIMENTS = ("ttft", "step", "pool", "spec")
WORDS = "and the children of Israel went up out of the land of Egypt unto the mount of God ".split()


def prompt_of(engine: TinyEngine, tokens: int) -> str:
    """A prompt of ``tokens`` tokens, give or take one where decoding and encoding again
    merge differently at the cut (``TtftRow.prompt_tokens`` counts what the engine got)."""
    ids = engine.tokenizer.encode(" ".join(WORDS[i % len(WORDS)] for i in range(tokens)))
    return engine.tokenizer.decode(ids[:tokens])


async def _run_all(engine: TinyEngine, requests: list[GenerationRequest]) -> list[RequestTimings]:
    streams = [await engine.start(r) for r in requests]

    async def drain(stream_index: int) -> None:
        async for _ in streams[stream_index]:
            pass

    async with asyncio.TaskGroup() as group:
        for i in range(len(streams)):
            group.create_task(drain(i))
    timings = [engine.timings(s.request_id) for s in streams]
    return [t for t in timings if t is not None]


async def _warm_up(engine: TinyEngine) -> None:
    """One short reply first, so the worker thread's start is not in any measurement."""
    await _run_all(engine, [GenerationRequest("And", SamplingParams(max_tokens=2))])


def _ms(seconds: float) -> float:
    return seconds * 1000.0


@dataclass(frozen=True, slots=True)
class TtftRow:
    prompt_tokens: int
    ttft_ms: float
    steps: int  # engine steps to the first token: the prefill's chunks
    tokens_per_s: float  # prompt tokens prefilled per second of TTFT


async def run_ttft(lab: LabEngine, lengths: tuple[int, ...], repeats: int) -> list[TtftRow]:
    """Median time from queued to first token, one request at a time, per prompt length."""
    engine = lab.engine()
    rows = []
    try:
        await _warm_up(engine)
        for n in lengths:
            prompt = prompt_of(engine, n)
            request = GenerationRequest(prompt, SamplingParams(max_tokens=1))
            samples = []
            for _ in range(repeats):
                steps_before = engine.stats().steps
                (t,) = await _run_all(engine, [request])
                assert t.first_token is not None
                samples.append(_ms(t.first_token - t.queued))
                steps = engine.stats().steps - steps_before
            n_tokens, ttft = engine.count_tokens(prompt), statistics.median(samples)
            rows.append(TtftRow(n_tokens, ttft, steps, n_tokens / (ttft / 1000.0)))
    finally:
        await engine.aclose()
    return rows


@dataclass(frozen=True, slots=True)
class StepRow:
    batch: int
    step_ms: float
    tokens_per_s: float


async def run_step(
    lab: LabEngine, batches: tuple[int, ...], tokens: int, repeats: int = 1
) -> list[StepRow]:
    """Median gap between tokens while ``batch`` sequences decode together.

    ``repeats`` rounds each go through every batch size, and a batch's figure is the median
    of its rounds: interleaved so that a busy moment on a shared machine lands on different
    batch sizes in different rounds, rather than on one size's only run.
    """
    engine = lab.engine(max_running=max(batches))
    steps: dict[int, list[float]] = {batch: [] for batch in batches}
    try:
        await _warm_up(engine)
        prompt = prompt_of(engine, 32)
        for _ in range(repeats):
            for batch in batches:
                requests = [
                    GenerationRequest(prompt, SamplingParams(max_tokens=tokens, seed=i))
                    for i in range(batch)
                ]
                timings = await _run_all(engine, requests)
                # The first gaps of a batch overlap the prefill of its later sequences.
                gaps = [b - a for t in timings for a, b in itertools.pairwise(t.tokens[4:])]
                steps[batch].append(statistics.median(gaps))
    finally:
        await engine.aclose()
    rows = []
    for batch in batches:
        step = statistics.median(steps[batch])
        rows.append(StepRow(batch, _ms(step), batch / step))
    return rows


@dataclass(frozen=True, slots=True)
class PoolRun:
    label: str
    num_blocks: int
    timings: list[RequestTimings]
    recomputed: int  # cached tokens preemption threw away, computed again

    @property
    def done_ms(self) -> float:
        """From the burst to the end of its last reply."""
        start = min(t.queued for t in self.timings)
        return _ms(max(t.finished or t.queued for t in self.timings) - start)

    @property
    def ttfts_ms(self) -> list[float]:
        return [_ms((t.first_token or t.queued) - t.queued) for t in self.timings]

    @property
    def max_gaps_ms(self) -> list[float]:
        return [
            _ms(max((b - a for a, b in zip(t.tokens, t.tokens[1:], strict=False)), default=0.0))
            for t in self.timings
        ]


# The pool experiment's large pool: every request of the burst fits at once.
POOL_HOLDS_ALL = 2048


async def run_pool(lab: LabEngine, requests: int, tokens: int, small_blocks: int) -> list[PoolRun]:
    """The same burst of requests on a pool that holds them all and on one that does not."""
    runs = []
    pools = (("pool holds all", POOL_HOLDS_ALL), (f"{small_blocks}-block pool", small_blocks))
    for label, blocks in pools:
        engine = lab.engine(num_blocks=blocks, max_running=requests)
        try:
            await _warm_up(engine)
            prompt = prompt_of(engine, 40)
            burst = [
                GenerationRequest(prompt, SamplingParams(max_tokens=tokens, seed=i))
                for i in range(requests)
            ]
            timings = await _run_all(engine, burst)
            runs.append(PoolRun(label, blocks, timings, engine.scheduler_stats().recomputed))
        finally:
            await engine.aclose()
    return runs


def _table(title: str, columns: list[str], rows: list[list[str]], console: Console) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def report_ttft(rows: list[TtftRow], out: Path, console: Console, model: str = "tiny") -> Path:
    _table(
        f"time to first token against prompt length ({model} engine, one request at a time)",
        ["prompt tokens", "TTFT, median", "prefill steps", "prompt tokens/s"],
        [
            [str(r.prompt_tokens), f"{r.ttft_ms:.2f} ms", str(r.steps), f"{r.tokens_per_s:,.0f}"]
            for r in rows
        ],
        console,
    )
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r.prompt_tokens for r in rows], [r.ttft_ms for r in rows], "o-")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"Prefill grows with the prompt ({model})")
    ax.grid(alpha=0.3)
    return _save(fig, out / plot_name("engine-ttft", model))


def report_step(rows: list[StepRow], out: Path, console: Console, model: str = "tiny") -> Path:
    _table(
        f"decode step time against running sequences ({model} engine)",
        ["batch", "ms per step", "tokens/s, all sequences"],
        [[str(r.batch), f"{r.step_ms:.2f}", f"{r.tokens_per_s:,.0f}"] for r in rows],
        console,
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    left.plot([r.batch for r in rows], [r.step_ms for r in rows], "o-")
    left.set_xlabel("sequences in the batch")
    left.set_ylabel("time per decode step (ms)")
    right.plot([r.batch for r in rows], [r.tokens_per_s for r in rows], "o-", color="#1e8449")
    right.set_xlabel("sequences in the batch")
    right.set_ylabel("tokens per second, all sequences")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"A bigger batch makes each step slower and the engine faster ({model})")
    return _save(fig, out / plot_name("engine-step", model))


def report_pool(runs: list[PoolRun], out: Path, console: Console, model: str = "tiny") -> Path:
    rows = []
    for run in runs:
        ttft, gaps = run.ttfts_ms, run.max_gaps_ms
        preempted = sum(1 for t in run.timings if t.preempted)
        rows.append(
            [
                run.label,
                f"{statistics.median(ttft):.1f} ms",
                f"{max(ttft):.1f} ms",
                f"{statistics.median(gaps):.1f} ms",
                f"{max(gaps):.1f} ms",
                f"{preempted}/{len(run.timings)}",
                f"{run.recomputed:,}",
                f"{run.done_ms:,.0f} ms",
            ]
        )
    _table(
        f"a burst of requests against KV capacity ({model} engine, engine-side times)",
        [
            "pool",
            "TTFT median",
            "TTFT max",
            "longest gap, median",
            "longest gap, max",
            "preempted",
            "tokens recomputed",
            "all done",
        ],
        rows,
        console,
    )
    fig, axes = plt.subplots(1, len(runs), figsize=(12, 5), dpi=110, sharex=True)
    for ax, run in zip(axes, runs, strict=True):
        start = min(t.queued for t in run.timings)
        for row, t in enumerate(run.timings):
            first = t.first_token or t.queued
            ax.plot([_ms(t.queued - start), _ms(first - start)], [row, row], color="#c0392b", lw=3)
            ax.plot(
                [_ms(x - start) for x in t.tokens],
                [row] * len(t.tokens),
                "|",
                ms=4,
                color="#2471a3",
            )
            for p in t.preempted:
                ax.plot(_ms(p - start), row, "x", color="black")
        ax.set_title(f"{model}: {run.label} ({run.num_blocks} blocks of 16)")
        ax.set_xlabel("ms since the burst (red: waiting, blue: tokens, x: preempted)")
        ax.set_ylabel("request")
        ax.invert_yaxis()
    return _save(fig, out / plot_name("engine-pool", model))


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


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
        "--requests", type=positive_int, default=16, help="pool: requests in the burst"
    )
    parser.add_argument(
        "--small-blocks",
        type=int_between(1, POOL_HOLDS_ALL - 1),
        default=40,
        help="pool: the small pool",
    )
    parser.add_argument(
        "--spec-tokens", type=positive_int, default=4, help="spec: draft tokens per step"
    )
    parser.add_argument(
        "--spec-ngram", type=positive_int, default=3, help="spec: longest n-gram looked up"
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="spec: 0 is greedy; above, seeded draws",
    )


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def run(args: argparse.Namespace) -> int:
    console = report_console()
    try:
        lab = load_lab_engine(args.engine, time.perf_counter)
    except (ValueError, OSError) as exc:
        print(f"replystream lab-engine: --engine: {exc}", file=sys.stderr)
        return 2
    sizes = lab.sizes
    lengths = args.lengths or sizes.ttft_lengths
    too_long = [n for n in lengths if n >= lab.context]
    if too_long:
        print(
            f"replystream lab-engine: --lengths: {too_long[0]} tokens leave no room for a reply "
            f"in the {lab.name} model's context of {lab.context}; give at most {lab.context - 1}",
            file=sys.stderr,
        )
        return 2
    repeats = args.repeats or sizes.repeats
    tokens = args.tokens or sizes.tokens
    console.print(f"engine: {lab.name} (loaded in {lab.load_seconds:.1f} s)")
    if args.experiment == "ttft":
        path = report_ttft(
            asyncio.run(run_ttft(lab, lengths, repeats)), args.out, console, lab.name
        )
    elif args.experiment == "step":
        batches = args.batches or sizes.step_batches
        rows = asyncio.run(run_step(lab, batches, tokens, repeats))
        path = report_step(rows, args.out, console, lab.name)
    elif args.experiment == "pool":
        try:
            runs = asyncio.run(run_pool(lab, args.requests, tokens, args.small_blocks))
        except RequestRejected as exc:  # the small pool cannot hold even one request
            print(
                f"replystream lab-engine: --small-blocks {args.small_blocks}: {exc}",
                file=sys.stderr,
            )
            return 2
        path = report_pool(runs, args.out, console, lab.name)
    else:
        spec = run_spec(lab, tokens, repeats, args.spec_tokens, args.spec_ngram, args.temperature)
        path = report_spec(asyncio.run(spec), args.out, console, args.temperature, lab.name)
    console.print(f"wrote {path}")
    return 0
