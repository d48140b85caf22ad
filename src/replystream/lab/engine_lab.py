"""``replystream lab-engine ttft|step|pool|spec``'s experiments: what prefill, batching, KV
capacity cost (the command line is ``lab.engine_lab_command``).

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

import asyncio
import itertools
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend is chosen first, above
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.runner import RequestTimings
from replystream.engine.tiny import TinyEngine
from replystream.lab.lab_engines import LabEngine, plot_name
from replystream.lab.spec_lab import PROMPTS as SPEC_PROMPTS

WORDS = "and the children of Israel went up out of the land of Egypt unto the mount of God ".split()


def prompt_of(engine: TinyEngine, tokens: int) -> str:
    """A prompt of ``tokens`` tokens, give or take one where decoding and encoding again
    merge differently at the cut (``TtftRow.prompt_tokens`` counts what the engine got)."""
    ids = engine.tokenizer.encode(" ".join(WORDS[i % len(WORDS)] for i in range(tokens)))
    return engine.tokenizer.decode(ids[:tokens])


async def _run_all(engine: TinyEngine, requests: list[GenerationRequest]) -> list[RequestTimings]:
    # Queued as one burst: were the worker to step while they are queued one by one (the
    # event loop's thread and its own take turns), the first could be decoding, or done,
    # before the last is admitted, and a batch would never decode together.
    with engine.runner.held():
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
    # Each round's step (its median gap): the spread a busy machine adds shows in them.
    rounds_ms: tuple[float, ...]
    # Each round's engine steps, prefill included: a batch decoded together takes as many as
    # one sequence does, one a step, where a batch decoded in turns would take more.
    rounds_steps: tuple[int, ...]

    @property
    def step_ms(self) -> float:
        return statistics.median(self.rounds_ms)

    @property
    def tokens_per_s(self) -> float:
        """Tokens made per second, all sequences together, at the median step."""
        return self.batch / (self.step_ms / 1000.0)


# The prompt of every sequence of the step experiment, in tokens (as ``prompt_of`` cuts it).
STEP_PROMPT_TOKENS = 32


async def run_step(
    lab: LabEngine, batches: tuple[int, ...], tokens: int, repeats: int = 1
) -> list[StepRow]:
    """Median gap between tokens while ``batch`` sequences decode together.

    The engine is built to hold the largest batch at once: its token budget prefills every
    sequence of a batch in one step and its pool holds all of their replies, so from the
    first token on each step decodes the whole batch (with the capacity ``serve`` gives the
    model, a batch past its 128-token budget would decode in turns, and ``batch`` over a
    sequence's gap would count tokens no step made). Gaps are taken where every sequence of
    the batch is decoding: after the last first token, up to the first last token.

    ``repeats`` rounds each go through every batch size, and a batch's figure is the median
    of its rounds: interleaved so that a busy moment on a shared machine lands on different
    batch sizes in different rounds, rather than on one size's only run.

    Raises:
        PoolTooLarge: the largest batch's replies need more memory than this machine has.
    """
    probe = lab.engine(num_blocks=1)  # for its tokenizer and prompt format
    prompt = prompt_of(probe, STEP_PROMPT_TOKENS)
    # Its end tokens banned, every reply runs to ``tokens``: no sequence leaves a batch early.
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompt_tokens = _fed_tokens(probe, prompt)
    blocks_each = _blocks_for(probe, prompt_tokens + tokens)
    largest = max(batches)
    engine = lab.engine(
        max_running=largest,
        token_budget=max(lab.config.token_budget, largest * prompt_tokens),
        num_blocks=max(lab.config.num_blocks, largest * blocks_each),
    )
    gaps: dict[int, list[float]] = {batch: [] for batch in batches}
    steps: dict[int, list[int]] = {batch: [] for batch in batches}
    try:
        await _warm_up(engine)
        for _ in range(repeats):
            for batch in batches:
                requests = [
                    GenerationRequest(prompt, replace(sampling, seed=i)) for i in range(batch)
                ]
                steps_before = engine.stats().steps
                timings = await _run_all(engine, requests)
                steps[batch].append(engine.stats().steps - steps_before)
                gaps[batch].append(statistics.median(_gaps_together(timings)))
    finally:
        await engine.aclose()
    return [StepRow(batch, tuple(map(_ms, gaps[batch])), tuple(steps[batch])) for batch in batches]


def _gaps_together(timings: list[RequestTimings]) -> list[float]:
    """The gaps between tokens while every sequence was decoding: each a whole batch's step."""
    start = max(t.tokens[0] for t in timings)
    end = min(t.tokens[-1] for t in timings)
    return [
        b - a for t in timings for a, b in itertools.pairwise(t.tokens) if start <= a and b <= end
    ]


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


def _fed_tokens(engine: TinyEngine, prompt: str) -> int:
    """The tokens ``engine`` feeds its model for ``prompt`` (its chat template may add some)."""
    return len(engine.prompts.prompt_ids(GenerationRequest(prompt)))


def _blocks_for(engine: TinyEngine, tokens: int) -> int:
    """The KV blocks a sequence of ``tokens`` tokens holds, and one spare: the scheduler
    admits a request only with a block to spare for each running sequence's next token."""
    return -(-tokens // engine.config.block_size) + 1


# The prompt of every request of the pool experiment's burst, in tokens.
POOL_PROMPT_TOKENS = 40


def pool_holding_all(lab: LabEngine, requests: int, tokens: int) -> int:
    """The blocks of the pool experiment's large pool: every request of the burst at once."""
    probe = lab.engine(num_blocks=1)  # for its tokenizer and prompt format
    prompt_tokens = _fed_tokens(probe, prompt_of(probe, POOL_PROMPT_TOKENS))
    return requests * _blocks_for(probe, prompt_tokens + tokens)


async def run_pool(lab: LabEngine, requests: int, tokens: int, small_blocks: int) -> list[PoolRun]:
    """The same burst of requests on a pool that holds them all and on one that does not.

    Raises:
        PoolTooLarge: the pool that holds every request needs more memory than there is.
    """
    runs = []
    holds_all = pool_holding_all(lab, requests, tokens)
    pools = (("pool holds all", holds_all), (f"{small_blocks}-block pool", small_blocks))
    for label, blocks in pools:
        engine = lab.engine(num_blocks=blocks, max_running=requests)
        try:
            await _warm_up(engine)
            prompt = prompt_of(engine, POOL_PROMPT_TOKENS)
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
        [
            "batch",
            "ms per step",
            "rounds, fastest-slowest",
            "tokens/s, all sequences",
            "engine steps a round",
        ],
        [
            [
                str(r.batch),
                f"{r.step_ms:.2f}",
                f"{min(r.rounds_ms):.2f}-{max(r.rounds_ms):.2f}",
                f"{r.tokens_per_s:,.0f}",
                _span(r.rounds_steps),
            ]
            for r in rows
        ],
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


def _span(counts: tuple[int, ...]) -> str:
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


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


def reply_room(lab: LabEngine, experiment: str) -> int:
    """How many tokens a reply may have after the experiment's longest prompt."""
    probe = lab.engine(num_blocks=1)  # for its tokenizer and prompt format
    if experiment == "spec":
        texts = list(SPEC_PROMPTS.values())
    else:
        texts = [
            prompt_of(probe, STEP_PROMPT_TOKENS if experiment == "step" else POOL_PROMPT_TOKENS)
        ]
    longest = max(_fed_tokens(probe, text) for text in texts)
    return lab.context - longest
