"""The relay served by ``--workers 2``: what an operator reads is right whichever worker
answers, and stays right when a worker dies and is restarted.

Real processes: ``replystream serve --engine simulated`` upstreams, and the relay
``replystream serve --engine upstream:... --workers 2``. Each of our connections is pinned to
a known worker (the worker whose ``/proc/PID/fd`` holds the accepted socket), so a test sends
requests to, scrapes, or kills one worker in particular.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from replystream.server.metrics import STATE_REFRESH_S
from tests.processes import replica, start_server, stop
from tests.rawhttp import RawResponse
from tests.services import free_port
from tests.test_workers import children_of

pytestmark = pytest.mark.slow

UPSTREAM = ("--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "0", "--tokens", "4")
CHAT: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}]}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def server_end(server_port: int, client_port: int) -> str | None:
    """The inode of the server's end of our connection from ``client_port`` (None while no
    process has accepted it: a queued connection's end has no file yet)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)) == (
            server_port,
            client_port,
        ):
            return None if fields[9] == "0" else fields[9]
    return None


def holder(inode: str, pids: Iterable[int]) -> int | None:
    """Which of ``pids`` holds socket ``inode`` (None: none of them)."""
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue  # closed while we looked
    return None


async def accepted_by(server_port: int, client_port: int, pids: Iterable[int]) -> int | None:
    """The worker of ``pids`` that accepted our connection from ``client_port``; None if it
    was not accepted within 5 s, or another process (another worker) accepted it."""
    for _ in range(100):
        inode = server_end(server_port, client_port)
        if inode is not None:
            # Accepted: the socket's file exists a moment before its descriptor is in the
            # worker's table, so a worker of ``pids`` is looked for a little while.
            for _ in range(20):
                owner = holder(inode, pids)
                if owner is not None:
                    return owner
                await asyncio.sleep(0.01)
            return None
        await asyncio.sleep(0.05)
    return None


class Pinned:
    """A keep-alive HTTP/1.1 connection that one known worker accepted."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int):
        self.reader, self.writer, self.pid = reader, writer, pid

    async def request(
        self, method: str, path: str, body: dict[str, object] | None = None
    ) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
        if data:
            lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        response = RawResponse(self.reader, self.writer)
        await response.read_head()
        return response.status, await response.read_body(close=False)

    async def scrape(self) -> Samples:
        status, text = await self.request("GET", "/metrics")
        assert status == 200
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples
        }

    async def aclose(self) -> None:
        await RawResponse(self.reader, self.writer).aclose()


@contextlib.asynccontextmanager
async def pin_each_worker(url: str, pids: list[int]) -> AsyncIterator[dict[int, Pinned]]:
    """One connection accepted by each of ``pids`` (new connections until each has one)."""
    pinned: dict[int, Pinned] = {}
    try:
        yield await _pin(url, pids, pinned)
    finally:
        for connection in pinned.values():
            await connection.aclose()


async def _pin(url: str, pids: list[int], pinned: dict[int, Pinned]) -> dict[int, Pinned]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    for attempt in range(200):
        if attempt:
            # The kernel gives a new connection to whichever worker accepts first: on a busy
            # machine the same one can win many times in a row, so the other gets a moment.
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        client_port = writer.get_extra_info("sockname")[1]
        try:
            owner = await accepted_by(parts.port, client_port, pids)
        except BaseException:  # one of ``pids`` gone meanwhile: no connection left open
            await RawResponse(reader, writer).aclose()
            raise
        if owner is None or owner in pinned:
            await RawResponse(reader, writer).aclose()
            continue
        pinned[owner] = Pinned(reader, writer, owner)
        await pinned[owner].request("GET", "/healthz")  # its first request, within the limit
        if len(pinned) == len(pids):
            return pinned
    raise AssertionError(f"could not reach every worker: {sorted(pinned)} of {pids}")


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every series of ``name`` that has ``labels`` (others may differ)."""
    wanted = set(labels.items())
    return sum(v for (n, series), v in samples.items() if n == name and wanted <= set(series))


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def new_worker(parent: int, old: list[int], timeout_s: float = 30.0) -> list[int]:
    """The parent's workers once it has replaced one of ``old``."""
    async with asyncio.timeout(timeout_s):
        while True:
            now = children_of(parent)
            if len(now) == len(old) and set(now) != set(old):
                return now
            await asyncio.sleep(0.1)


async def test_upstream_metrics_of_two_workers_read_as_one_servers_and_survive_a_restart():
    async with (
        replica(*UPSTREAM) as (_, first),
        replica(*UPSTREAM) as (_, second),
    ):
        bases = [f"{first}/v1", f"{second}/v1"]
        relay_args = [f"--engine=upstream:{b}" for b in bases]
        relay_args += ["--upstream-health-s", "0.5", "--workers", "2"]
        async with (
            replica(*relay_args) as (relay_process, relay),
            pin_each_worker(relay, children_of(relay_process.pid)) as pinned,
        ):
            (doomed, spared), workers = pinned.values(), list(pinned)
            for connection, replies in ((doomed, 3), (spared, 2)):
                for _ in range(replies):
                    status, body = await connection.request("POST", "/v1/chat/completions", CHAT)
                    assert status == 200, body
            await asyncio.sleep(STATE_REFRESH_S * 1.5)  # every worker has written its counts
            for connection in pinned.values():
                seen = await connection.scrape()
                for base in bases:
                    # Each worker's circuit is closed and its last probe answered: the
                    # values the docs give, not one per worker added up.
                    assert value(seen, "replystream_upstream_circuit", upstream=base) == 0
                    assert value(seen, "replystream_upstream_probe_ok", upstream=base) == 1
                    assert value(seen, "replystream_upstream_outstanding", upstream=base) == 0
                assert total(seen, "replystream_upstream_attempts", result="ok") == 5
                # Each worker opened one connection to each upstream it sent to, and kept it.
                opened = total(seen, "replystream_upstream_connections_opened")
                assert 2 <= opened <= 4, seen
                assert 1 <= total(seen, "replystream_upstream_connections_idle") <= opened
            probes_before = total(seen, "replystream_upstream_probes", result="ok")

            os.kill(doomed.pid, signal.SIGKILL)
            (newcomer,) = set(await new_worker(relay_process.pid, workers)) - set(workers)
            async with pin_each_worker(relay, [newcomer]) as fresh:
                # It has answered /healthz, so it has probed; then it writes its readings.
                await asyncio.sleep(STATE_REFRESH_S * 1.5)
                seen = await spared.scrape()
                # The dead worker's attempts and probes are still counted: counts since start.
                assert total(seen, "replystream_upstream_attempts", result="ok") == 5
                assert total(seen, "replystream_upstream_probes", result="ok") > probes_before
                assert total(seen, "replystream_upstream_connections_opened") == opened
                for base in bases:
                    assert value(seen, "replystream_upstream_probe_ok", upstream=base) == 1
                status, _ = await fresh[newcomer].request("POST", "/v1/chat/completions", CHAT)
                assert status == 200
                await asyncio.sleep(STATE_REFRESH_S * 1.5)
                seen = await spared.scrape()
                assert total(seen, "replystream_upstream_attempts", result="ok") == 6
                assert total(seen, "replystream_upstream_connections_opened") == opened + 1


async def test_an_upstream_circuit_open_in_both_workers_reads_open():
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    relay_args = [f"--engine=upstream:{dead}", "--workers", "2", "--upstream-failures", "1"]
    relay_args += ["--upstream-cooldown-s", "60", "--upstream-health-s", "60"]
    async with (
        replica(*relay_args) as (relay_process, relay),
        pin_each_worker(relay, children_of(relay_process.pid)) as pinned,
    ):
        for connection in pinned.values():  # one failure each: both open their circuit
            status, body = await connection.request("POST", "/v1/chat/completions", CHAT)
            assert status == 502, body
        await asyncio.sleep(STATE_REFRESH_S * 1.5)
        for connection in pinned.values():
            seen = await connection.scrape()
            assert value(seen, "replystream_upstream_circuit", upstream=dead) == 2  # open
            assert value(seen, "replystream_upstream_probe_ok", upstream=dead) == 0
            refused = value(
                seen, "replystream_upstream_attempts", upstream=dead, result="connect_error"
            )
            assert refused == 2
            status, body = await connection.request("GET", "/healthz")
            assert status == 503 and json.loads(body)["status"] == "unavailable"


async def test_a_worker_stopped_mid_reply_leaves_its_last_counts_in_the_totals():
    slow = ("--engine", "simulated", "--delay-ms", "100", "--jitter-ms", "0", "--tokens", "200")
    async with replica(*slow) as (_, upstream):
        base = f"{upstream}/v1"
        relay_args = [f"--engine=upstream:{base}", "--workers", "2", "--shutdown-grace-s", "0"]
        async with (
            replica(*relay_args) as (relay_process, relay),
            pin_each_worker(relay, children_of(relay_process.pid)) as pinned,
        ):
            (stopped, spared), workers = pinned.values(), list(pinned)
            streamed = asyncio.create_task(
                stopped.request("POST", "/v1/chat/completions", {**CHAT, "stream": True})
            )
            await asyncio.sleep(STATE_REFRESH_S * 1.5)  # under way, and its state written
            os.kill(stopped.pid, signal.SIGTERM)  # this worker alone: it ends its replies
            status, body = await asyncio.wait_for(streamed, 30)
            assert status == 200 and b'"code":"shutdown"' in body
            await new_worker(relay_process.pid, workers)
            seen = await spared.scrape()
            outcome = {"endpoint": "/v1/chat/completions", "outcome": "shutdown"}
            assert value(seen, "replystream_replies_total", **outcome) == 1
            # The attempt that reply's end cancelled is counted too, though it ended after
            # the worker last wrote its readings on its clock.
            assert (
                value(seen, "replystream_upstream_attempts", upstream=base, result="cancelled") == 1
            )
            assert value(seen, "replystream_upstream_outstanding", upstream=base) == 0


async def test_a_worker_that_refuses_to_start_again_waits_while_the_other_serves(tmp_path: Path):
    async with replica(*UPSTREAM) as (_, upstream):
        routes = tmp_path / "routes.toml"
        good = f'[[upstreams]]\nurl = "{upstream}/v1"\n'
        routes.write_text(good)
        process, url = await start_server(
            "--engine", "upstream", "--upstream-routes", str(routes), "--workers", "2"
        )
        try:
            workers = children_of(process.pid)
            async with pin_each_worker(url, workers):
                pass  # each has answered a request: both read the file while it was right
            routes.write_text("[[upstreams]]\nurl = 'ftp://nowhere'\n")  # broken meanwhile
            os.kill(workers[0], signal.SIGKILL)
            # Its replacement reads the broken file and refuses, as one process would; the
            # other worker serves on with the routes it read, and the place is tried again.
            await asyncio.sleep(2.0)  # several tries: 0.2 s, then twice as long each
            assert process.returncode is None and alive(workers[1])
            async with pin_each_worker(url, [workers[1]]) as pinned:
                status, _ = await pinned[workers[1]].request("GET", "/v1/models")
            assert status == 200
            routes.write_text(good)  # fixed: the next try starts, and serves
            async with asyncio.timeout(30):
                while True:
                    replaced = await new_worker(process.pid, workers)
                    # A try that still refused: it exits (its /proc goes) or never accepts.
                    with contextlib.suppress(AssertionError, OSError):
                        async with pin_each_worker(url, replaced):
                            break
                    await asyncio.sleep(0.2)
            assert workers[1] in replaced
        finally:
            await stop(process)


async def test_routed_by_prefix_a_conversation_meets_one_upstream_through_either_worker():
    """The preference keeps no state: a conversation's turns, each through another worker,
    reach one upstream."""
    named = [("--reply-text", name, "--delay-ms", "1", "--jitter-ms", "0") for name in "abc"]
    async with (
        replica("--engine", "simulated", *named[0]) as (_, a),
        replica("--engine", "simulated", *named[1]) as (_, b),
        replica("--engine", "simulated", *named[2]) as (_, c),
    ):
        relay_args = [f"--engine=upstream:{url}/v1" for url in (a, b, c)]
        relay_args += ["--upstream-routing", "prefix", "--workers", "2"]
        relay_args += ["--upstream-health-s", "60"]
        async with (
            replica(*relay_args) as (relay_process, relay),
            pin_each_worker(relay, children_of(relay_process.pid)) as pinned,
        ):
            first, second = pinned.values()
            homes = set()
            for n in range(8):
                messages = [{"role": "user", "content": f"conversation {n}: hello"}]
                answers = []
                for worker in (first, second, first):  # each turn through the other worker
                    status, body = await worker.request(
                        "POST", "/v1/chat/completions", {"messages": messages}
                    )
                    assert status == 200, body
                    answer = json.loads(body)["choices"][0]["message"]["content"]
                    answers.append(answer)
                    messages = [
                        *messages,
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": "and then?"},
                    ]
                assert len(set(answers)) == 1, (n, answers)
                homes.add(answers[0])
            assert len(homes) >= 2, homes  # 8 conversations over 3 upstreams: not all on one
