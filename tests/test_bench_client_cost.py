"""bench's own cost: the load client's CPU per event read, and its warning when the client,
not the server, may be what limits the figures.

The real run drives the client hard: a server in its own process writes a prebuilt reply of
20,000 one-token events per request as fast as the socket takes it, so the client's parsing is
the work. Whether the client then reaches a full core depends on what else the machine runs,
so that run pins the figures and that the warning follows them; the judgement's two sides are
pinned with the measurements given.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rich.console import Console

from replystream.client import ReplyTiming
from replystream.lab.bench_report import CLIENT_LIMITED, render, render_sweep
from replystream.lab.benchstats import CLIENT_LIMIT_MIN_WALL_S, CLIENT_LIMIT_SHARE, summarize
from replystream.lab.load_types import LoadConfig, LoadRun, RequestRecord
from replystream.lab.local_server import stop_process

EVENTS = 20_000
# A server that answers every request with one prebuilt event stream and closes.
BLAST_SERVER = f"""
import asyncio
BODY = (
    b"HTTP/1.1 200 OK\\r\\nContent-Type: text/event-stream\\r\\nConnection: close\\r\\n\\r\\n"
    + b'data: "a"\\n\\n' * {EVENTS} + b"data: [DONE]\\n\\n"
)
async def handle(reader, writer):
    await reader.readuntil(b"\\r\\n\\r\\n")
    writer.write(BODY)
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


@pytest.fixture
async def blast_server() -> AsyncIterator[str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BLAST_SERVER, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        port = int(await asyncio.wait_for(process.stdout.readline(), 30))
        yield f"http://127.0.0.1:{port}"
    finally:
        await stop_process(process)


async def test_the_clients_cpu_per_event_is_reported_and_judged(blast_server, tmp_path: Path):
    out = tmp_path / "cost.json"
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "replystream", "bench", f"{blast_server}/stream", "--quiet"),
        *("--concurrency", "2", "--requests", "6", "--json", str(out)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    text = stdout.decode()
    client = json.loads(await asyncio.to_thread(out.read_text))["client"]
    assert client["events_read"] == 6 * EVENTS
    assert 0.0 < client["cpu_share_of_one_core"] < 1.5
    assert client["cpu_us_per_event"] == pytest.approx(1e6 * client["cpu_s"] / (6 * EVENTS))
    # Parsing one small event takes microseconds, not milliseconds.
    assert 0.1 < client["cpu_us_per_event"] < 1000.0
    assert f"{client['cpu_us_per_event']:,.1f} µs of CPU per text event read" in text
    assert client["limit_share"] == CLIENT_LIMIT_SHARE
    judged = client["wall_s"] >= CLIENT_LIMIT_MIN_WALL_S
    busy = client["cpu_share_of_one_core"] > CLIENT_LIMIT_SHARE
    assert client["client_limited"] == (judged and busy)
    assert (CLIENT_LIMITED in text) == client["client_limited"]


def _record(index: int) -> RequestRecord:
    events = tuple(10.0 + i for i in range(100))
    timing = ReplyTiming(
        url="http://h/stream",
        streamed=True,
        complete=True,
        error=None,
        status=200,
        headers_ms=1.0,
        first_chunk_ms=10.0,
        first_text_ms=10.0,
        last_text_ms=events[-1],
        closed_ms=events[-1] + 1.0,
        body_bytes=1000,
        text="a" * 100,
        tokens=100,
        text_event_ms=events,
    )
    return RequestRecord(index, 0.01 * index, 0, None, timing)


def _printed(summary: dict[str, object]) -> str:
    console = Console(record=True, width=200)
    render(summary, console)
    return console.export_text()


@pytest.mark.parametrize(("cpu_s", "limited"), [(0.95, True), (0.5, False)])
def test_the_warning_appears_when_the_client_used_nearly_a_core(cpu_s, limited):
    config = LoadConfig(url="http://h/stream", api="lab", requests=10)
    records = tuple(_record(i) for i in range(10))
    summary = summarize(LoadRun(config, records, wall_s=1.0, client_cpu_s=cpu_s))
    client = summary["client"]
    assert client["client_limited"] is limited
    assert client["cpu_us_per_event"] == pytest.approx(1e6 * cpu_s / 1000)
    text = _printed(summary)
    assert f"{100 * cpu_s:.1f} % of one core" in text
    assert (CLIENT_LIMITED in text) is limited


def test_a_run_that_read_no_event_is_not_blamed_on_the_client():
    """Every request refused at once: the CPU share of an instant is not a busy client."""
    config = LoadConfig(url="http://h/stream", api="lab", requests=2)
    refused = ReplyTiming(
        url="http://h/stream",
        streamed=False,
        complete=False,
        error="read failed: cannot connect to h:80",
        status=None,
        headers_ms=None,
        first_chunk_ms=None,
        first_text_ms=None,
        last_text_ms=None,
        closed_ms=0.2,
        body_bytes=0,
        text="",
        tokens=0,
    )
    records = tuple(RequestRecord(i, 0.0, 0, None, refused) for i in range(2))
    summary = summarize(LoadRun(config, records, wall_s=0.001, client_cpu_s=0.00101))
    assert summary["client"]["cpu_share_of_one_core"] > CLIENT_LIMIT_SHARE
    assert summary["client"]["client_limited"] is False
    assert CLIENT_LIMITED not in _printed(summary)


def test_a_run_over_in_an_instant_is_not_blamed_on_the_client():
    """Every stream cut after its first events: a busy instant is the client's start and end."""
    config = LoadConfig(url="http://h/stream", api="lab", requests=10)
    records = tuple(_record(i) for i in range(10))
    summary = summarize(LoadRun(config, records, wall_s=0.004, client_cpu_s=0.0037))
    assert summary["client"]["cpu_share_of_one_core"] > CLIENT_LIMIT_SHARE
    assert summary["client"]["client_limited"] is False
    assert CLIENT_LIMITED not in _printed(summary)


def test_a_sweep_marks_the_rates_where_the_client_was_the_limit():
    config = LoadConfig(url="http://h/stream", api="lab", requests=10)
    records = tuple(_record(i) for i in range(10))
    # (profile, its target and judged rate, the client's CPU seconds over 1 s of wall time)
    runs: list[tuple[str, float | None, float | None, float]] = [
        ("synchronous", None, 5.0, 0.1),
        ("throughput", None, None, 0.9),
        ("constant", 20.0, 20.0, 0.5),
        ("constant", 35.0, 35.0, 0.97),
    ]
    result = {
        "sweep": {
            "synchronous_rate": 5.0,
            "max_throughput_rate": 50.0,
            "steps": 2,
            "step": 22.5,
            "rates": [20.0, 35.0],
            "slos": {},
            "slo_share": 0.95,
            "knee_rate": None,
        },
        "runs": [
            {
                "profile": profile,
                "target_rate": target,
                "rate": rate,
                "summary": summarize(LoadRun(config, records, 1.0, cpu_s)),
            }
            for profile, target, rate, cpu_s in runs
        ],
    }
    console = Console(record=True, width=200)
    render_sweep(result, console)
    text = console.export_text()
    assert f"{CLIENT_LIMITED} in the runs marked ! (throughput, 35.00 req/s)" in text
    assert text.count(" ! │") == 2
