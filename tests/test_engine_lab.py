"""The engine lab's experiments, scaled down: each yields its rows and writes its PNG."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from replystream.lab.engine_lab import (
    PoolRun,
    report_pool,
    report_step,
    report_ttft,
    run_pool,
    run_step,
    run_ttft,
)
from replystream.lab.lab_engines import LabEngine, load_lab_engine
from replystream.lab.spec_lab import PROMPTS as SPEC_PROMPTS
from replystream.lab.spec_lab import SpecRun, report_spec, run_spec
from tests.services import require_smollm2


@pytest.fixture(scope="module")
def tiny() -> LabEngine:
    return load_lab_engine("tiny", time.perf_counter)


def test_ttft_experiment_reports_each_prompt_length(tiny: LabEngine, tmp_path: Path) -> None:
    rows = asyncio.run(run_ttft(tiny, (8, 128), repeats=1))
    assert [r.prompt_tokens for r in rows] == [8, 128]
    assert all(r.ttft_ms > 0 for r in rows)
    assert [r.steps for r in rows] == [1, 1]  # within the 128-token budget: one step
    with open(tmp_path / "t.txt", "w") as sink:
        path = report_ttft(rows, tmp_path, Console(file=sink))
    assert path.stat().st_size > 0


def test_step_experiment_reports_each_batch(tiny: LabEngine, tmp_path: Path) -> None:
    # How much faster a batch makes tokens is the experiment's figure, measured, not a test's
    # (``benchmarks/engine_decode.py`` times it); that it was a batch is checked here: four
    # sequences of 12 tokens took as many engine steps as one did, one token each a step.
    rows = asyncio.run(run_step(tiny, (1, 4), tokens=12, repeats=3))
    assert [r.batch for r in rows] == [1, 4]
    assert [len(r.rounds_ms) for r in rows] == [3, 3]
    assert all(ms > 0 for r in rows for ms in r.rounds_ms)
    assert [r.rounds_steps for r in rows] == [(12, 12, 12)] * 2
    with open(tmp_path / "t.txt", "w") as sink:
        assert report_step(rows, tmp_path, Console(file=sink)).exists()


def test_step_experiment_decodes_a_batch_past_the_serving_budget_together(
    tiny: LabEngine,
) -> None:
    # Past the 128-token budget ``serve`` gives the tiny model, a batch would decode in turns
    # and its "step" be one turn's. The experiment's engine holds the largest batch at once:
    # 512 sequences take as many steps as 128 do (prefill of all in the first).
    rows = asyncio.run(run_step(tiny, (128, 512), tokens=6))
    assert [r.rounds_steps for r in rows] == [(6,), (6,)]


def test_step_experiment_runs_with_the_fewest_tokens(tiny: LabEngine) -> None:
    (row,) = asyncio.run(run_step(tiny, (2,), tokens=2))
    assert row.step_ms > 0


def test_pool_experiment_shows_queueing_and_preemption(tiny: LabEngine, tmp_path: Path) -> None:
    big, small = asyncio.run(run_pool(tiny, requests=6, tokens=60, small_blocks=10))
    assert len(big.timings) == len(small.timings) == 6
    assert not any(t.preempted for t in big.timings) and big.recomputed == 0
    assert any(t.preempted for t in small.timings) and small.recomputed > 0

    # Structure, not magnitudes (the machine is shared): in the small pool some request made
    # its first token only after another had finished (it waited for blocks); in the big
    # pool every request started before any finished.
    def waited_for_blocks(run: PoolRun) -> bool:
        finished = [t.finished for t in run.timings if t.finished is not None]
        firsts = [t.first_token for t in run.timings if t.first_token is not None]
        return bool(finished) and max(firsts) > min(finished)

    assert waited_for_blocks(small)
    assert not waited_for_blocks(big)
    with open(tmp_path / "t.txt", "w") as sink:
        assert report_pool([big, small], tmp_path, Console(file=sink)).exists()


def _by_prompt(runs: list[SpecRun]) -> dict[str, tuple[SpecRun, SpecRun]]:
    """Each prompt's (plain, lookup) runs."""
    pairs = {}
    for prompt in SPEC_PROMPTS:
        plain, lookup = (r for r in runs if r.prompt == prompt)
        pairs[prompt] = (plain, lookup)
    return pairs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_spec_experiment_makes_the_same_text_in_fewer_steps_where_drafts_come_true(
    tiny: LabEngine, tmp_path: Path, temperature: float
) -> None:
    runs = asyncio.run(run_spec(tiny, 24, 1, spec_tokens=4, ngram=2, temperature=temperature))
    assert [(r.mode, r.prompt) for r in runs] == [
        (mode, prompt) for mode in ("plain", "lookup k=4 n=2") for prompt in SPEC_PROMPTS
    ]
    for plain, lookup in _by_prompt(runs).values():
        # Speculation changes how many steps the text takes, never the text (sampled too:
        # a drafted token is kept only where the seeded sampler would have drawn it).
        assert plain.text and lookup.text == plain.text
        assert plain.tokens == lookup.tokens == 24
        assert (plain.steps, plain.events, plain.proposed, plain.acceptance) == (24, 24, 0, None)
        assert [n for _, n in plain.arrivals_ms] == list(range(1, 25))
        assert lookup.accepted <= lookup.proposed
        # one event a step, carrying the step's token and its accepted drafts
        assert lookup.events == lookup.steps == lookup.tokens - lookup.accepted
        assert lookup.arrivals_ms[-1][1] == 24
        times = [t for t, _ in lookup.arrivals_ms]
        assert times == sorted(times) and times[0] == 0.0
    plain, lookup = _by_prompt(runs)["repetitive"]
    assert lookup.accepted > 0 and lookup.steps < plain.steps
    with open(tmp_path / "t.txt", "w") as sink:
        path = report_spec(runs, tmp_path, Console(file=sink), temperature)
    said = (tmp_path / "t.txt").read_text()
    assert "repetitive: the same text in both modes: yes" in said
    assert "prose: the same text in both modes: yes" in said
    sampled = "" if temperature == 0 else "-sampled"
    assert path == tmp_path / f"engine-spec{sampled}.png" and path.stat().st_size > 0


def test_the_spec_experiment_runs_from_the_command_line(tmp_path: Path) -> None:
    argv = ["lab-engine", "spec", "--engine", "tiny", "--tokens", "12", "--repeats", "1"]
    argv += ["--spec-tokens", "3", "--spec-ngram", "2", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "replystream", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "lookup k=3 n=2" in done.stdout and "wrote" in done.stdout
    assert "the same text in both modes: NO" not in done.stdout
    assert done.stdout.count("the same text in both modes: yes") == 2
    assert (tmp_path / "engine-spec.png").stat().st_size > 0


def test_the_tiny_models_plots_keep_their_names_and_others_carry_the_model(
    tiny: LabEngine, tmp_path: Path
) -> None:
    rows = asyncio.run(run_ttft(tiny, (8,), repeats=1))
    with open(tmp_path / "t.txt", "w") as sink:
        assert report_ttft(rows, tmp_path, Console(file=sink)).name == "engine-ttft.png"
        named = report_ttft(rows, tmp_path, Console(file=sink), "smollm2")
    assert named.name == "engine-ttft-smollm2.png"


def test_the_lab_measures_the_real_model_with_chunked_prefill(tmp_path: Path) -> None:
    require_smollm2()
    lab = load_lab_engine("smollm2", time.perf_counter)
    assert (lab.name, lab.context, lab.config.token_budget) == ("smollm2", 8192, 256)
    short, long = asyncio.run(run_ttft(lab, (16, 600), repeats=1))
    assert abs(short.prompt_tokens - 16) <= 1 and abs(long.prompt_tokens - 600) <= 1
    # 600 prompt tokens through a 256-token budget: three prefill chunks, three steps.
    assert (short.steps, long.steps) == (1, 3)
    rows = asyncio.run(run_step(lab, (1, 3), tokens=8))
    assert [r.batch for r in rows] == [1, 3]
    with open(tmp_path / "t.txt", "w") as sink:
        assert report_ttft([short, long], tmp_path, Console(file=sink), lab.name).exists()
        assert report_step(rows, tmp_path, Console(file=sink), lab.name).exists()
    assert (tmp_path / "engine-ttft-smollm2.png").exists()
    assert (tmp_path / "engine-step-smollm2.png").exists()


def test_a_burst_of_requests_is_admitted_at_one_step(tiny: LabEngine) -> None:
    """The experiments queue their requests as one burst: the worker, running beside the
    event loop, takes none of them before all are queued, so all are scheduled at one step
    (one by one, the first could be decoding, or done, before the last came in)."""
    from replystream.engine.base import GenerationRequest, SamplingParams
    from replystream.lab.engine_lab import _run_all

    async def burst() -> set[float | None]:
        engine = tiny.engine(max_running=64, token_budget=64 * 40, num_blocks=512)
        try:
            await _run_all(engine, [GenerationRequest("And", SamplingParams(max_tokens=2))])
            asks = [
                GenerationRequest(f"Once upon a time {i}", SamplingParams(max_tokens=4))
                for i in range(64)
            ]
            return {t.scheduled for t in await _run_all(engine, asks)}
        finally:
            await engine.aclose()

    assert len(asyncio.run(burst())) == 1


def test_a_gguf_whose_chat_template_fails_is_refused_naming_the_file(tmp_path: Path) -> None:
    from tests.gguf_files import write_llama_gguf

    path = write_llama_gguf(tmp_path / "m.gguf", meta={"tokenizer.chat_template": "{{ 1 / 0 }}"})
    with pytest.raises(ValueError, match=f"^{path}: the chat template fails on one user message"):
        load_lab_engine(f"gguf:{path}", time.perf_counter)
