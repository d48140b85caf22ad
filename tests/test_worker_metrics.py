"""``replystream serve --workers 2``: one scrape of ``/metrics`` counts every worker's replies.

A real parent process with two workers on one port. Each of our streams is held open until
both workers hold at least one of them (their sockets show in ``/proc/PID/fd``), so the
counts a single worker could report are always short of the totals.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from replystream.client import measure_reply
from replystream.client.measure import ReplyTiming
from tests.processes import start_server, stop
from tests.rawhttp import raw_request
from tests.test_gateway_workers import pin_each_worker
from tests.test_workers import children_of

TOKENS = 40
DELAY_MS = 100  # each reply streams for about 4 s: long enough to count who holds it


def sockets_of(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            continue  # closed while we looked
    return count


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One scrape on a new connection (so any worker may answer), as {(name, labels): value}."""
    response = await raw_request(f"{url}/metrics")
    text = (await response.read_body()).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape_until(url: str, name: str, expected: float, timeout_s: float = 20.0) -> None:
    """Scrape until the unlabelled gauge ``name`` reads ``expected`` (workers publish their
    gauges about once a second)."""
    seen = None
    for _ in range(int(timeout_s / 0.2)):
        seen = value(await scrape(url), name)
        if seen == expected:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{name} stayed at {seen}, expected {expected}")


async def test_one_scrape_counts_the_replies_of_every_worker():
    process, url = await start_server(
        "--engine",
        "simulated",
        "--tokens",
        str(TOKENS),
        "--delay-ms",
        str(DELAY_MS),
        "--jitter-ms",
        "0",
        "--workers",
        "2",
    )
    try:
        workers = children_of(process.pid)
        assert len(workers) == 2
        # The URL is announced once every worker accepts connections; count their sockets
        # once each has also answered a request.
        async with pin_each_worker(url, workers):
            pass
        baseline = {pid: sockets_of(pid) for pid in workers}
        streams: list[asyncio.Task[ReplyTiming]] = []
        # One connection at a time until both workers hold some (the kernel picks who).
        while len(streams) < 40 and not all(sockets_of(pid) > baseline[pid] for pid in workers):
            streams.append(asyncio.create_task(measure_reply(f"{url}/stream")))
            await asyncio.sleep(0.1)
        held = {pid: sockets_of(pid) - baseline[pid] for pid in workers}
        assert all(count > 0 for count in held.values()), held
        opened = len(streams)

        # While they stream: the live gauge sums both workers' open streams.
        await scrape_until(url, "replystream_active_streams", opened)

        assert all(t.complete for t in await asyncio.gather(*streams))
        for _ in range(6):  # each scrape may land on either worker: every one has the totals
            samples = await scrape(url)
            finished = value(
                samples, "replystream_replies_total", endpoint="/stream", outcome="finished"
            )
            assert finished == opened
            tokens = value(samples, "replystream_tokens_generated_total", endpoint="/stream")
            assert tokens == opened * TOKENS
            gaps = value(
                samples, "replystream_time_between_tokens_seconds_count", endpoint="/stream"
            )
            assert gaps == opened * (TOKENS - 1)
        # Every worker's state gauges, summed: nothing open once the streams have ended.
        await scrape_until(url, "replystream_replies_in_flight", 0)
        assert value(await scrape(url), "replystream_active_streams") == 0

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        await stop(process)
