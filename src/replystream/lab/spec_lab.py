"""``replystream lab-engine spec``: prompt-lookup speculative decoding against plain decoding.

One request at a time (greedy by default; ``temperature`` > 0 samples with a fixed seed), in
this process, on the engine under test (``lab.lab_engines``) with and without speculation, for
a repetitive prompt (where drafts come true) and plain prose (where they rarely do). It reports
steps, deltas (events), tokens per event, draft acceptance and TPOT from the engine's own
timestamps, checks that both modes made the same text, prints a table and writes a PNG of when
the tokens arrived. It must not know about HTTP.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend is chosen first, above
from rich.console import Console
from rich.table import Table

from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.tiny import TinyEngine
from replystream.lab.lab_engines import LabEngine, plot_name

PROMPTS = {
    "repetitive": "the children of Judah, the children of Levi, the children of Judah, the "
    "children of Benjamin, the children of Judah, the children of",
    "prose": "And it came to pass, when Joseph was come unto his brethren,",
}


@dataclass(frozen=True, slots=True)
class SpecRun:
    """One mode on one prompt: medians over the repeats (the text is the same each time)."""

    mode: str
    prompt: str
    tokens: int
    steps: int
    events: int
    proposed: int
    accepted: int
    tpot_ms: float
    total_ms: float
    arrivals_ms: tuple[tuple[float, int], ...]  # (ms since the first token, tokens so far)
    text: str

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


async def _one(
    engine: TinyEngine, prompt: str, tokens: int, temperature: float = 0.0
) -> tuple[SpecRun, float]:
    before_steps = engine.stats().steps
    before = engine.scheduler_stats()
    params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=1)
    request = GenerationRequest(prompt, params)
    stream = await engine.start(request)
    parts, arrivals, made = [], [], 0
    async for delta in stream:
        parts.append(delta.text)
        made += delta.tokens
        arrivals.append((delta.made_at, made))
    after = engine.scheduler_stats()
    timings = engine.timings(stream.request_id)
    assert timings is not None and timings.first_token is not None
    first, last = timings.tokens[0], timings.tokens[-1]
    tpot = (last - first) / max(1, made - 1)
    total = (last - timings.queued) * 1000.0
    run = SpecRun(
        mode="",
        prompt="",
        tokens=made,
        steps=engine.stats().steps - before_steps,
        events=len(arrivals),
        proposed=after.draft_proposed - before.draft_proposed,
        accepted=after.draft_accepted - before.draft_accepted,
        tpot_ms=tpot * 1000.0,
        total_ms=total,
        arrivals_ms=tuple(((t - first) * 1000.0, n) for t, n in arrivals),
        text="".join(parts),
    )
    return run, tpot


async def run_spec(
    lab: LabEngine,
    tokens: int,
    repeats: int,
    spec_tokens: int,
    ngram: int,
    temperature: float = 0.0,
) -> list[SpecRun]:
    """Every prompt in both modes; TPOT and total are medians over ``repeats`` runs."""
    runs = []
    for mode, k in (("plain", 0), (f"lookup k={spec_tokens} n={ngram}", spec_tokens)):
        engine = lab.engine(spec_tokens=k, spec_ngram=ngram)
        try:
            await _one(engine, "And", 2)  # start the worker thread outside the measurement
            for name, prompt in PROMPTS.items():
                samples = [await _one(engine, prompt, tokens, temperature) for _ in range(repeats)]
                middle = sorted(samples, key=lambda s: s[1])[len(samples) // 2][0]
                total = statistics.median(s[0].total_ms for s in samples)
                runs.append(replace(middle, mode=mode, prompt=name, total_ms=total))
        finally:
            await engine.aclose()
    return runs


def report_spec(
    runs: list[SpecRun], out: Path, console: Console, temperature: float = 0.0, model: str = "tiny"
) -> Path:
    """Print the table (and whether the texts matched); write ``engine-spec.png``."""
    how = "greedy" if temperature == 0 else f"temperature {temperature:g}, seed 1"
    table = Table(title=f"prompt-lookup speculative decoding ({model} engine, {how}, engine times)")
    columns = ["mode", "prompt", "tokens", "steps", "events", "tok/ev", "accepted", "TPOT"]
    for column in [*columns, "total"]:
        table.add_column(column, justify="right")
    for r in runs:
        rate = "-" if r.acceptance is None else f"{r.accepted}/{r.proposed}"
        table.add_row(
            r.mode,
            r.prompt,
            str(r.tokens),
            str(r.steps),
            str(r.events),
            f"{r.tokens / r.events:.2f}",
            rate,
            f"{r.tpot_ms:.2f}ms",
            f"{r.total_ms:.0f}ms",
        )
    console.print(table)
    for prompt in PROMPTS:
        texts = {r.text for r in runs if r.prompt == prompt}
        console.print(
            f"{prompt}: the same text in both modes: {'yes' if len(texts) == 1 else 'NO'}"
        )
    fig, axes = plt.subplots(1, len(PROMPTS), figsize=(12, 4.5), dpi=110)
    for ax, prompt in zip(axes, PROMPTS, strict=True):
        for r in runs:
            if r.prompt == prompt:
                xs = [0.0] + [t for t, _ in r.arrivals_ms]
                ys = [0] + [n for _, n in r.arrivals_ms]
                ax.step(xs, ys, where="post", label=f"{r.mode}: {r.steps} steps")
        ax.set_title(f"{prompt} prompt")
        ax.set_xlabel("ms since the first token (engine clock)")
        ax.set_ylabel("tokens made")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(f"Accepted drafts arrive several tokens per step ({model}, {how})")
    fig.tight_layout()
    path = out / plot_name("engine-spec" if temperature == 0 else "engine-spec-sampled", model)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
