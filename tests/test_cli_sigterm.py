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

from replystream.engine import SimulatedConfig, SimulatedEngine
from tests.conftest import serve_engine, wait_for


async def test_sigterm_stops_a_bench_run_and_reports_what_ended(tmp_path: Path) -> None:
    engine = SimulatedEngine(SimulatedConfig(delay_ms=20.0, jitter_ms=0.0))
    out_json = tmp_path / "run.json"
    async with serve_engine(engine) as url:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replystream", "bench", f"{url}/stream",
            *("--concurrency", "2", "--duration", "600", "--output-tokens", "5"),
            *("--json", str(out_json)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
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


async def test_sigterm_stops_the_lab_and_the_server_it_started() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replystream", "lab", "--calls", "3", "--tokens", "500", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
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
