"""Chaos, bounded: 300 clients for about a minute through nginx to two replicas sharing Redis
(a primary, its replica and Sentinel), with random drops, resumes and cancels, while one
replica and then the Redis primary are SIGKILLed at random moments.

Each client starts a resumable reply (its own seed: its own timing) at a random moment and
does one of three things, drawn from its own seeded random source: reads it whole; drops the
connection after a random number of events, waits, and resumes with ``Last-Event-ID`` (up to
three times); or cancels it after a few events and reads on to its end. A resume or a new
reply refused while a replica or Redis is down (a 5xx) is tried again for a while, as a
client would. The moments of both kills come from the run's seed (printed; set
``REPLYSTREAM_CHAOS_SEED`` to replay a run).

Accounting, as in the failover test (``tests/failover_scenario.py``, whose reader this
reuses): every client has the exact text (the simulated engine's, the same for every seed),
or was told (a ``gap``, ``generator_lost``, another ``error`` event, or an HTTP error it
gave up on), or was cancelled (its text a strict prefix of the reply's: it stopped); no
silent loss, no event id seen twice.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from replystream.client.transport import http_request
from tests.failover_scenario import ENGINE, Client, read_stream
from tests.nginx import running_nginx
from tests.processes import start_server, stop
from tests.redis_server import redis_with_sentinel
from tests.services import free_port
from tests.test_scale_out import upstream_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLIENTS = 300
START_WITHIN_S = 35.0  # clients start at random moments in this window
REFUSED_RETRY_S = 30.0  # how long a client tries again after a 5xx or a refused connection


@dataclass
class ChaosClient(Client):
    plan: str = "whole"
    cancelled: bool = False  # its cancel was accepted
    gave_up: bool = False  # resumed MAX_RESUMES times without reaching the reply's end
    http_errors: list[str] = field(default_factory=list)


@dataclass
class Counts:
    exact: int = 0
    told_gap: int = 0
    told_lost: int = 0
    told_error: collections.Counter[str] = field(default_factory=collections.Counter)
    cancelled: int = 0
    silent: int = 0
    duplicated: int = 0

    def line(self) -> str:
        return (
            f"clients {CLIENTS}: exact {self.exact}, told gap {self.told_gap}, told lost "
            f"{self.told_lost}, told another error {dict(self.told_error)}, cancelled "
            f"{self.cancelled}, silent losses {self.silent}, duplicates {self.duplicated}"
        )


def account(clients: list[ChaosClient], expected: str) -> Counts:
    counts = Counts()
    for client in clients:
        counts.duplicated += client.duplicated
        if client.gave_up:
            counts.silent += 1
        elif client.done and client.text == expected and not client.gaps:
            counts.exact += 1
        elif client.gaps:
            counts.told_gap += 1
        elif client.error == "cancelled" and client.cancelled:
            # Stopped: what it got is the reply's beginning, and not all of it.
            if expected.startswith(client.text) and len(client.text) < len(expected):
                counts.cancelled += 1
            else:
                counts.silent += 1
        elif client.error == "generator_lost":
            counts.told_lost += 1
        elif client.error is not None:
            counts.told_error[client.error] += 1
        else:
            counts.silent += 1
    return counts


MAX_RESUMES = 50  # a stream that keeps ending with no end of the reply is a bug: silent


def refused(error: str | None) -> bool:
    return (error or "").startswith(("http_5", "connection"))


async def until_taken(attempt: Callable[[], Awaitable[object]], client: ChaosClient) -> None:
    """``attempt()`` (a read into ``client``), tried again while it is refused (a 5xx, or a
    connection refused: a replica or Redis is down) for up to REFUSED_RETRY_S. A read cut
    after some events returns: the caller resumes after the last."""
    deadline = time.monotonic() + REFUSED_RETRY_S
    pause = 0.2
    while True:
        before = len(client.ids)
        try:
            await attempt()
        except OSError as exc:  # the client's transport errors are ConnectionErrors
            if len(client.ids) > before:
                return
            client.error = f"connection: {type(exc).__name__}"
        if not refused(client.error) or time.monotonic() >= deadline:
            return
        client.http_errors.append(client.error or "")
        client.error = None
        await asyncio.sleep(pause)
        pause = min(pause * 2, 2.0)


async def run_client(base: str, n: int, client: ChaosClient, rng: random.Random) -> None:
    await asyncio.sleep(rng.uniform(0, START_WITHIN_S))
    body = json.dumps({"prompt": "x", "resumable": True, "seed": n}).encode()
    client.plan = rng.choice(["whole", "drops", "drops", "cancel"])
    first = {"whole": None, "drops": rng.randint(1, 60), "cancel": rng.randint(2, 20)}
    made: list[str] = []

    async def start() -> None:
        reply_id = await read_stream(
            f"{base}/v1/replies", client, body=body, stop_after=first[client.plan]
        )
        if reply_id is not None:
            made.append(reply_id)

    await until_taken(start, client)
    if not made:
        client.gave_up = client.error is None  # no reply, and not told why: silent
        return
    reply_id = made[0]
    if client.plan == "cancel" and not client.done and client.error is None:
        client.cancelled = await cancel(base, reply_id)
    drops = rng.randint(1, 3) if client.plan == "drops" else 0
    url = f"{base}/v1/replies/{reply_id}/stream"
    for _ in range(MAX_RESUMES):
        if client.done or client.error is not None:
            return
        await asyncio.sleep(rng.uniform(0, 1.5) if drops else 0)
        stop_after = rng.randint(5, 60) if drops else None
        drops = max(0, drops - 1)
        await until_taken(partial(resume, url, client, stop_after), client)
    client.gave_up = True


async def resume(url: str, client: ChaosClient, stop_after: int | None) -> None:
    """Follow the reply after the last event the client has (that many events, or all)."""
    await read_stream(url, client, after=client.ids[-1], stop_after=stop_after)


async def cancel(base: str, reply_id: str) -> bool:
    """Ask (through nginx, so on either replica) for the reply to stop; retried while
    refused."""
    deadline = time.monotonic() + REFUSED_RETRY_S
    while time.monotonic() < deadline:
        try:
            async with http_request(f"{base}/v1/replies/{reply_id}/cancel", method="POST") as r:
                if r.status == 200:  # asked for, unless the reply had ended already
                    body = b"".join([chunk.data async for chunk in r])
                    return bool(json.loads(body)["cancel_requested"])
                if r.status < 500:
                    return False
        except OSError:
            pass
        await asyncio.sleep(0.5)
    return False


async def test_chaos_300_clients_drops_resumes_cancels_a_replica_and_the_primary_killed(
    tmp_path: Path,
):
    seed = int(os.environ.get("REPLYSTREAM_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    replica_kill_at = rng.uniform(8, 25)
    primary_kill_at = rng.uniform(12, 30)
    killed_replica = rng.randrange(2)
    print(
        f"chaos seed {seed}: replica {killed_replica} killed at {replica_kill_at:.1f} s, "
        f"the Redis primary at {primary_kill_at:.1f} s"
    )
    with redis_with_sentinel(tmp_path / "redis") as redis:
        args = (*ENGINE, "--redis-url", redis.url, "--redis-failover-s", "20")
        processes = [await start_server(*args) for _ in range(2)]
        try:
            reference = Client()
            await read_stream(f"{processes[0][1]}/v1/replies", reference, body=b'{"prompt": "x"}')
            assert reference.done and reference.text
            port = free_port()
            config = upstream_config(port, [url for _, url in processes])
            async with running_nginx(config, port, tmp_path / "nginx") as base:
                clients = [ChaosClient() for _ in range(CLIENTS)]
                began = time.monotonic()

                async def kill_replica() -> None:
                    await asyncio.sleep(replica_kill_at)
                    processes[killed_replica][0].kill()
                    print(f"replica {killed_replica} SIGKILLed at {time.monotonic() - began:.1f} s")

                async def kill_primary() -> None:
                    await asyncio.sleep(primary_kill_at)
                    redis.primary.kill()
                    print(f"Redis primary SIGKILLed at {time.monotonic() - began:.1f} s")
                    await asyncio.get_running_loop().run_in_executor(None, redis.wait_for_failover)
                    print(f"Sentinel promoted the replica at {time.monotonic() - began:.1f} s")

                async with asyncio.timeout(240), asyncio.TaskGroup() as group:
                    group.create_task(kill_replica())
                    group.create_task(kill_primary())
                    for n, client in enumerate(clients):
                        client_rng = random.Random(f"{seed}:{n}")
                        group.create_task(run_client(base, n, client, client_rng))
                took = time.monotonic() - began
        finally:
            for process, _ in processes:
                await stop(process)
    counts = account(clients, reference.text)
    plans = collections.Counter(c.plan for c in clients)
    print(f"chaos seed {seed}, {took:.0f} s, plans {dict(plans)}")
    print(counts.line())
    assert counts.silent == 0, counts.line()
    assert counts.duplicated == 0, counts.line()
    told = counts.told_gap + counts.told_lost + sum(counts.told_error.values())
    assert counts.exact + told + counts.cancelled == CLIENTS
    assert counts.cancelled > 0 and counts.exact > CLIENTS // 2, counts.line()
