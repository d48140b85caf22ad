"""``replystream lab`` end to end: a real server process, real HTTP, the JSON contract."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fast_engine, serve_engine

LAB = [sys.executable, "-m", "replystream", "lab"]
SMALL = ["--calls", "4", "--tokens", "12", "--delay-ms", "20", "--jitter-ms", "4"]


def test_lab_json_contract_and_shape_of_the_result():
    done = subprocess.run([*LAB, *SMALL, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # --json prints only the JSON object
    for mode in ("wait", "stream"):
        assert result[mode]["calls"] == result[mode]["complete"] == 4
        for metric in ("first_text_ms", "total_ms"):
            assert set(result[mode][metric]) >= {"median", "p95"}
    wait, stream = result["wait"], result["stream"]
    # Buffered: the first text is the whole reply. Streamed: it comes about one token in.
    assert wait["first_text_ms"] == wait["total_ms"]
    assert stream["first_text_ms"]["median"] < wait["first_text_ms"]["median"] / 3
    # The same schedules end at about the same time in both modes (generous: noisy machine).
    assert abs(result["total_median_diff_pct"]) < 15
    assert result["config"]["tokens"] == 12 and result["config"]["calls"] == 4


def test_lab_writes_timeline_plot_and_result_line(tmp_path: Path):
    done = subprocess.run(
        [*LAB, *SMALL, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    assert json.loads(last.removeprefix("RESULT "))["stream"]["complete"] == 4
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert len(timeline["stream"]["arrivals"]) == 12
    assert len(timeline["wait"]["arrivals"]) == 1
    times = [a["t_ms"] for a in timeline["stream"]["arrivals"]]
    assert times == sorted(times)
    assert (
        "".join(a["text"] for a in timeline["stream"]["arrivals"])
        == (timeline["wait"]["arrivals"][0]["text"])
    )
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("bad", [["--calls", "0"], ["--tokens", "0"]])
def test_lab_refuses_nonsense_options(bad: list[str]):
    done = subprocess.run([*LAB, *bad, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "must be at least 1" in done.stderr


async def test_lab_against_a_failing_server_reports_incomplete_and_exits_nonzero():
    # Every reply fails after 3 tokens (the warm-up asks for 1): nothing may count as a result.
    engine = fast_engine(fail_after=3)
    async with serve_engine(engine) as url:
        process = await asyncio.create_subprocess_exec(
            *LAB, "--url", url, "--calls", "2", "--json", stdout=asyncio.subprocess.PIPE
        )
        stdout, _ = await process.communicate()
    assert process.returncode == 1
    result = json.loads(stdout)
    assert result["stream"]["complete"] == result["wait"]["complete"] == 0
    assert result["stream"]["first_text_ms"]["median"] is None
    assert result["first_text_sooner_ms"] is None
    assert any("simulated failure" in e for e in result["stream"]["errors"])
