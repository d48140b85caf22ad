"""The engine lab's experiments, scaled down: each yields its rows and writes its PNG."""

from __future__ import annotations

import asyncio
from pathlib import Path

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


def test_ttft_experiment_reports_each_prompt_length(tmp_path: Path) -> None:
    rows = asyncio.run(run_ttft((8, 128), repeats=1))
    assert [r.prompt_tokens for r in rows] == [8, 128]
    assert all(r.ttft_ms > 0 for r in rows)
    with open(tmp_path / "t.txt", "w") as sink:
        path = report_ttft(rows, tmp_path, Console(file=sink))
    assert path.stat().st_size > 0


def test_step_experiment_reports_each_batch(tmp_path: Path) -> None:
    rows = asyncio.run(run_step((1, 4), tokens=12))
    assert [r.batch for r in rows] == [1, 4]
    assert rows[1].tokens_per_s > rows[0].tokens_per_s  # batching raises throughput
    with open(tmp_path / "t.txt", "w") as sink:
        assert report_step(rows, tmp_path, Console(file=sink)).exists()


def test_pool_experiment_shows_queueing_and_preemption(tmp_path: Path) -> None:
    big, small = asyncio.run(run_pool(requests=6, tokens=24, small_blocks=10))
    assert len(big.timings) == len(small.timings) == 6
    assert not any(t.preempted for t in big.timings)
    assert any(t.preempted for t in small.timings)

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
