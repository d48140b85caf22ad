"""Reply lifecycles interleaved at random against one real server process (the driver:
``tests/lifecycle_fuzz.py``): streams started on every route and cut, resumed, joined,
cancelled, deleted and polled from other connections at random moments, some read on a
narrow link by a reader that stops keeping up until the server cuts it as a slow client.
Every reader's text is the engine's, no event id repeats or goes missing within a stream,
nothing is answered with a 5xx or left unanswered, the server logs no error, and its gauges
come back.

The seed is fixed, so every run draws the same plans (the loop's timing still varies);
``REPLYSTREAM_LIFECYCLE_SEED`` draws others, to look further or to replay a failure found so.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from tests.lifecycle_expect import BANNED, REPLY_TEXT, SLOW_CLIENT_BYTES
from tests.lifecycle_fuzz import Kill, log_problems, run
from tests.processes import launch, ready_url, stop
from tests.redis_server import redis_server

# Fast tokens; a detach grace short enough that some resumes come after it; slow-client
# limits that a narrow reader which stops keeping up passes within the reply (none other
# ever has a write wait: loopback's buffers are megabytes).
SERVE = (
    *("--engine", "simulated", "--delay-ms", "3", "--jitter-ms", "1", "--detach-grace-s", "1"),
    *("--reply-text", REPLY_TEXT, "--ban", BANNED),
    *("--slow-client-bytes", str(SLOW_CLIENT_BYTES), "--slow-client-s", "1"),
)
CLIENTS, EPISODES = 40, 8
SEED = 22  # fixed: every run draws the same plans (the loop's timing still varies)

pytestmark = pytest.mark.timeout(120)


async def fuzz(
    tmp_path: Path, extra: tuple[str, ...], replicas: int, *, kill_one: bool = False
) -> None:
    """Run the seed's plans against ``replicas`` server processes started with ``extra``;
    with ``kill_one``, the last is killed at a moment the seed draws."""
    seed = int(os.environ.get("REPLYSTREAM_LIFECYCLE_SEED", SEED))
    print(f"lifecycle seed {seed}")
    logs = [tmp_path / f"server{n}.log" for n in range(replicas)]
    processes = []
    try:
        for log in logs:
            with log.open("wb") as errors:
                processes.append(
                    await launch(*SERVE, *extra, stderr=errors.fileno(), module="tests.narrow_link")
                )
        urls = [await ready_url(process) for process in processes]
        kill = None
        if kill_one:
            after_s = random.Random(f"{seed}:kill").uniform(0.3, 2.5)
            kill = Kill(urls[-1], after_s, processes[-1].kill)
        async with asyncio.timeout(90):
            result = await run(seed, urls, CLIENTS, EPISODES, kill)
    finally:
        for process in processes:
            await stop(process)
    failures = result.failures + [
        f"server log: {line}" for log in logs for line in log_problems(log.read_text())
    ]
    shown = ("ending", "narrow", "lost") if not failures else ("",)
    counts = {k: v for k, v in sorted(result.counts.items()) if k.startswith(shown)}
    print(f"lifecycle seed {seed}: {len(result.replies)} replies; {counts}")
    assert not failures, "\n".join(failures[:20])
    assert len(result.replies) == CLIENTS * EPISODES


async def test_random_interleavings_of_reply_lifecycles_keep_every_reader_whole(tmp_path: Path):
    await fuzz(tmp_path, (), replicas=1)


async def test_random_interleavings_across_two_replicas_on_redis(tmp_path: Path):
    # Every reply started on one replica may be resumed, joined, cancelled, deleted or polled
    # on the other.
    with redis_server(tmp_path / "redis") as redis:
        await fuzz(tmp_path, ("--redis-url", redis.url), replicas=2)


async def test_a_replica_killed_mid_run_loses_only_its_own_replies(tmp_path: Path):
    # SIGKILL, mid-run: the replies it produced end generator_lost for their readers on the
    # other replica (a Responses reader gets response.failed), none hangs, and every other
    # reply, started before or after, is whole on the survivor.
    with redis_server(tmp_path / "redis") as redis:
        await fuzz(tmp_path, ("--redis-url", redis.url), replicas=2, kill_one=True)
