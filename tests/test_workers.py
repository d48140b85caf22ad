"""``replystream serve --workers 2``: two processes on one port, sharing replies through Redis."""

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from replystream.client import ResumingReader, measure_reply
from replystream.client.resume import Backoff
from replystream.server.workers import STOP_MARGIN_S
from replystream.sse import EventParser
from tests.processes import launch, ready_url, start_server, stop
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
                reader.reply_id, reader.last_event_id = reply_id, ""
                parts = [
                    json.loads(e.data)["text"] async for e in reader.events() if e.type == "token"
                ]
                texts.append("".join(parts))
            assert len(set(texts)) == 1 and len(texts[0].split()) == 120
            process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(process.wait(), 20) == 0
        finally:
            await stop(process)


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def test_workers_whose_parent_is_killed_end_their_streams_and_free_the_port():
    process, url = await start_server(
        "--engine", "simulated", "--delay-ms", "50", "--workers", "2", "--shutdown-grace-s", "0"
    )
    workers = children_of(process.pid)
    try:
        assert len(workers) == 2
        reply = await raw_request(f"{url}/v1/replies", "POST", b'{"prompt": "x"}')
        assert reply.status == 200
        await asyncio.sleep(1)  # a few tokens under way
        process.send_signal(signal.SIGKILL)  # the parent alone: no one forwards a signal
        # Each worker notices it has no parent: it shuts down as on SIGTERM, so the stream
        # ends with a named error, and the port is not held by a server nobody supervises.
        async with asyncio.timeout(30):
            body = await reply.read_body()
            while any(alive(pid) for pid in workers):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert b"event: token" in body
        assert body.rstrip().endswith(b'"code": "shutdown"}}'), body[-200:]
        with pytest.raises(OSError):
            await raw_request(f"{url}/healthz")
    finally:
        await stop(process)
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_worker_that_does_not_stop_is_killed_after_the_grace_and_its_margin():
    process = await launch(
        "--engine", "simulated", "--workers", "2", "--shutdown-grace-s", "0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    workers: list[int] = []
    try:
        await ready_url(process)
        workers = children_of(process.pid)
        os.kill(workers[0], signal.SIGSTOP)  # stands for a worker whose loop hangs
        loop = asyncio.get_running_loop()
        began = loop.time()
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), STOP_MARGIN_S + 15)
        waited = loop.time() - began
        assert process.stderr is not None
        said = (await process.stderr.read()).decode()
        assert f"worker {workers[0]} did not stop within the shutdown grace" in said, said
        assert STOP_MARGIN_S <= waited, waited  # the other stopped at once; this one was waited for
        assert not [pid for pid in workers if alive(pid)]
        assert process.returncode == 1  # not a graceful stop: said in the exit status too
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        await stop(process)


async def test_a_worker_that_dies_during_the_stop_is_said_and_fails_the_exit_status():
    process = await launch(
        "--engine", "simulated", "--delay-ms", "50", "--workers", "2",
        "--shutdown-grace-s", "30",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    workers: list[int] = []
    try:
        url = await ready_url(process)
        workers = children_of(process.pid)
        before = {pid: sockets_of(pid) for pid in workers}
        reply = await raw_request(f"{url}/v1/replies", "POST", b'{"prompt": "x"}')
        await reply.reader.readuntil(b"event: token")
        (serving,) = [pid for pid in workers if sockets_of(pid) > before[pid]]
        (idle,) = [pid for pid in workers if pid != serving]
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(1)  # the stop under way: the reply has its grace to finish in
        os.kill(serving, signal.SIGKILL)  # the OOM killer, say: the reply is cut
        await asyncio.wait_for(process.wait(), 30)
        assert process.stderr is not None
        said = (await process.stderr.read()).decode()
        assert f"worker {serving} was killed by SIGKILL while the server stopped" in said, said
        assert f"worker {idle}" not in said, said  # it stopped gracefully
        assert process.returncode == 1
        await reply.aclose()
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        await stop(process)


def sockets_of(pid: int) -> int:
    """The sockets a process holds open (its listening socket, the connections it took)."""
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held += os.readlink(fd).startswith("socket:")
    return held


async def test_a_burst_of_connections_is_spread_over_every_worker():
    # One listening socket shared: whichever worker woke first took all it found queued (a
    # burst of 80 once went 49 / 5 / 3 / 35). A socket each: the kernel spreads them.
    process, url = await start_server(
        *("--engine", "simulated", "--tokens", "400", "--delay-ms", "20", "--workers", "4")
    )
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = b'{"prompt": "x"}'
    head = b"POST /v1/replies HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
    ask = head % len(body) + body
    connections = []
    try:
        workers = children_of(process.pid)
        before = {pid: sockets_of(pid) for pid in workers}
        for _ in range(80):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(ask)
            connections.append((reader, writer))
        for reader, _ in connections:  # every stream under way: each taken by a worker
            await reader.readuntil(b"event: token")
        taken = {pid: sockets_of(pid) - before[pid] for pid in workers}
    finally:
        for _, writer in connections:
            writer.close()
        await stop(process)
    assert sum(taken.values()) == 80, taken
    assert min(taken.values()) >= 8, taken  # 20 each on average


async def test_every_worker_down_at_once_is_said_and_so_is_the_first_back():
    process = await launch(
        "--engine", "simulated", "--workers", "2", stderr=asyncio.subprocess.PIPE
    )  # fmt: skip
    workers: list[int] = []
    try:
        url = await ready_url(process)
        workers = children_of(process.pid)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert process.stderr is not None
        said: list[str] = []
        async with asyncio.timeout(30):
            while not said or "a worker is serving again" not in said[-1]:
                said.append((await process.stderr.readline()).decode())
        told = "".join(said)
        assert told.index("no worker is serving") < told.index("a worker is serving again")
        assert told.count("no worker is serving") == 1, told
        timing = await measure_reply(f"{url}/stream")  # served again
        assert timing.complete
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        await stop(process)


async def test_a_worker_stopped_alone_takes_no_new_connection_while_it_drains():
    """A SIGTERM sent to one worker: it stops listening and finishes its replies, while the
    others take every new connection. The parent kept its own copy of the worker's socket
    open, so the kernel went on queueing about half the new connections to a socket nobody
    accepted from, each waiting out the worker's whole drain."""
    process = await launch(
        *("--engine", "simulated", "--tokens", "1000", "--delay-ms", "20", "--workers", "2"),
        *("--shutdown-grace-s", "60"),
        stderr=asyncio.subprocess.PIPE,
    )
    streams = []
    try:
        url = await ready_url(process)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        workers = children_of(process.pid)
        before = {pid: sockets_of(pid) for pid in workers}
        body = b'{"prompt": "x"}'
        ask = b"POST /v1/replies HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body),
            body,
        )
        for _ in range(12):  # replies under way on both workers, most likely
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(ask)
            await reader.readuntil(b"event: token")
            streams.append(writer)
        taken = {pid: sockets_of(pid) - before[pid] for pid in workers}
        draining = max(taken, key=lambda pid: taken[pid])
        os.kill(draining, signal.SIGTERM)
        assert process.stderr is not None
        async with asyncio.timeout(30):  # its drain has begun: it no longer listens
            while b"shutting down" not in await process.stderr.readline():
                pass
        for _ in range(20):
            async with asyncio.timeout(5):  # the drain lasts a minute
                answer = await raw_request(f"{url}/healthz")
                assert answer.status == 200
                await answer.read_body()
        assert alive(draining)  # still draining: the others answered every one
    finally:
        for writer in streams:
            writer.close()
        await stop(process)


async def test_a_second_ctrl_c_ends_the_workers_grace_and_tells_the_replies_in_band():
    """A terminal's Ctrl-C reaches the parent and every worker: the first stops the server
    gracefully (replies go on), a second ends the grace, as it does for one process. It was
    forwarded as the first was, and each worker took it for the copy of a signal it had."""
    args = ("--engine", "simulated", "--tokens", "400", "--delay-ms", "50", "--jitter-ms", "0")
    process = await launch(*args, "--workers", "2", "--shutdown-grace-s", "60", session=True)
    try:
        url = await ready_url(process, 60.0)
        async with aiohttp.ClientSession() as http:
            streams = [
                await http.post(f"{url}/v1/replies", json={"prompt": "hi"}) for _ in range(4)
            ]
            for stream in streams:
                await stream.content.readuntil(b"event: token")
            os.killpg(process.pid, signal.SIGINT)
            await asyncio.sleep(1.0)
            assert process.returncode is None  # draining: each reply (20 s) outlasts this
            for stream in streams:  # still flowing, none cut by the first Ctrl-C
                await asyncio.wait_for(stream.content.readuntil(b"event: token"), 5)
            started = time.monotonic()
            os.killpg(process.pid, signal.SIGINT)
            endings = [EventParser().feed(await stream.read())[-1] for stream in streams]
            assert await asyncio.wait_for(process.wait(), 30) == 0
            took = time.monotonic() - started
    finally:
        await stop(process)
    for ending in endings:
        assert ending.type == "error", ending
        assert json.loads(ending.data)["error"]["code"] == "shutdown"
    assert took < 15, took  # not the 60 s grace
