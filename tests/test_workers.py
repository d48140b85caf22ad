"""``replystream serve --workers 2``: two processes on one port, sharing replies through Redis."""

import asyncio
import json
import signal
from pathlib import Path

from replystream.client import ResumingReader, measure_reply
from replystream.client.resume import Backoff
from tests.processes import start_server, stop
from tests.rawhttp import raw_request
from tests.redis_server import redis_server


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


async def test_two_workers_serve_one_port_and_resume_each_others_replies(tmp_path: Path):
    with redis_server(tmp_path) as redis:
        process, url = await start_server(
            "--engine",
            "simulated",
            "--delay-ms",
            "5",
            "--jitter-ms",
            "1",
            "--workers",
            "2",
            "--redis-url",
            redis.url,
        )
        try:
            assert len(children_of(process.pid)) == 2
            timings = await asyncio.gather(*(measure_reply(f"{url}/stream") for _ in range(40)))
            assert all(t.complete for t in timings)
            # Cut after two events, then resume: the resume may land on either worker.
            start = await raw_request(
                f"{url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
            )
            reply_id = start.headers["x-reply-id"]
            await start.reader.readuntil(b"\n\n")
            await start.reader.readuntil(b"\n\n")
            await start.aclose()
            texts = []
            for _ in range(4):  # a few resumes: both workers answer some of them
                reader = ResumingReader(url, backoff=Backoff(base_s=0.01, max_attempts=10))
                reader.reply_id, reader.last_event_id = reply_id, 0
                parts = [
                    json.loads(e.data)["text"] async for e in reader.events() if e.type == "token"
                ]
                texts.append("".join(parts))
            assert len(set(texts)) == 1 and len(texts[0].split()) == 120
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 20) == 0
        finally:
            await stop(process)
