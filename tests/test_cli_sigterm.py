"""A measuring command sent SIGTERM stops as on Ctrl-C: it reports what ended, stops the
server it started, and exits 143, where dying at once left no report, a terminal without its
cursor (the progress bar hides it) and, for a moment, the lab's server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from replystream.engine import SimulatedConfig, SimulatedEngine
from tests.conftest import serve_engine, wait_for


def _deaf_to_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's shell starts a job with `&`


@pytest.mark.parametrize("started", ["foreground", "background"])
async def test_sigterm_stops_a_bench_run_and_reports_what_ended(
    tmp_path: Path, started: str
) -> None:
    # A background job of a script ignores SIGINT (the shell's doing), and SIGTERM is how it
    # is stopped: it killed bench at once there, with no report and no file.
    engine = SimulatedEngine(SimulatedConfig(delay_ms=20.0, jitter_ms=0.0))
    out_json = tmp_path / "run.json"
    async with serve_engine(engine) as url:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replystream", "bench", f"{url}/stream",
            *("--concurrency", "2", "--duration", "600", "--output-tokens", "5"),
            *("--json", str(out_json)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_deaf_to_ctrl_c if started == "background" else None,
        )  # fmt: skip
        await asyncio.sleep(3.0)  # started, warmed up, and a few requests ended
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            out, err = await process.communicate()
    assert process.returncode == 143, err
    assert b"Traceback" not in err
    assert "interrupted" in out.decode()
    result = json.loads(await asyncio.to_thread(out_json.read_text))
    assert result["counts"]["interrupted"] is True
    assert result["counts"]["complete"] >= 1


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("started", ["foreground", "background"])
async def test_sigterm_stops_the_lab_and_the_server_it_started(started: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replystream", "lab", "--calls", "3", "--tokens", "500", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=_deaf_to_ctrl_c if started == "background" else None,
    )  # fmt: skip
    await wait_for(lambda: bool(_children(process.pid)), timeout_s=30)
    (server,) = _children(process.pid)
    await asyncio.sleep(1.0)  # its calls in flight
    process.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        _, err = await process.communicate()
    assert process.returncode == 143, err
    assert b"Traceback" not in err
    left = _alive(server)
    if left:
        os.kill(server, signal.SIGKILL)
    assert not left
