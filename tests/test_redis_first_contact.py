"""``serve --redis-url`` asks Redis once before it listens: a Redis that refuses the store's
commands (a wrong password, none given where one is needed, a database it lacks, an ACL user
without a command or key the store uses) is a start-up error of one line that names Redis by
host and port only; one that cannot be reached yet is told, and the server serves."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import StoreUnavailable
from tests.processes import replica
from tests.redis_server import RedisServer, redis_server
from tests.services import free_port

CLI = [sys.executable, "-m", "replystream", "serve", "--engine", "simulated"]
SECRET = "s3cr%t@p:ss/w#rd"  # "%2540" and the like in a URL
QUOTED = "s3cr%25t%40p%3Ass%2Fw%23rd"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis-acl")) as server:
        admin = redis.Redis(port=server.port)
        admin.acl_setuser(
            "alice",
            enabled=True,
            passwords=[f"+{SECRET}"],
            keys=["*"],
            channels=["*"],
            commands=["+@all"],
        )
        admin.acl_setuser(
            "bob",
            enabled=True,
            passwords=["+bobpw"],
            keys=["*"],
            commands=["+@all", "-evalsha", "-eval"],
        )
        admin.acl_setuser(
            "carol", enabled=True, passwords=["+carolpw"], keys=["other:*"], commands=["+@all"]
        )
        # Users given EVALSHA but not what the store sends beside it: SCRIPT LOAD (a script
        # Redis lacks, after its restart, is loaded first), EVAL (a repair's script) and
        # INFO (which server answers: a restart that lost every reply; -@dangerous takes it).
        for user, refused in (("erin", "-script"), ("frank", "-eval"), ("gina", "-@dangerous")):
            admin.acl_setuser(
                user,
                enabled=True,
                passwords=[f"+{user}pw"],
                keys=["*"],
                channels=["*"],
                commands=["+@all", refused],
            )
        admin.config_set("requirepass", "defaultpw")  # NOAUTH without a password
        admin.close()
        yield server


def serve(url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    argv = [*CLI, "--port", str(free_port()), "--redis-url", url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, env=env)


@pytest.mark.parametrize(
    ("auth", "db", "says"),
    [
        ("alice:wrongpw@", 0, "invalid username-password pair"),
        ("", 0, "authenticated"),  # NOAUTH
        ("bob:bobpw@", 0, "no permissions to run the 'evalsha' command"),
        ("carol:carolpw@", 0, "no permissions to access one of the keys"),
        ("erin:erinpw@", 0, "no permissions to run the 'script|load' command"),
        ("frank:frankpw@", 0, "no permissions to run the 'eval' command"),
        ("gina:ginapw@", 0, "no permissions to run the 'info' command"),
        (f"alice:{QUOTED}@", 99, "DB index is out of range"),
    ],
)
def test_a_redis_that_refuses_the_stores_commands_stops_start_up_in_one_line(
    acl_redis: RedisServer, auth: str, db: int, says: str
):
    done = serve(f"redis://{auth}127.0.0.1:{acl_redis.port}/{db}")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    where = f"Redis at redis://127.0.0.1:{acl_redis.port}/{db} refuses"
    assert lines[0].startswith(f"replystream serve: --redis-url: {where}"), lines[0]
    assert says in lines[0], lines[0]
    assert "pw" not in lines[0] and "s3cr" not in lines[0]


def test_a_redis_without_script_load_stops_start_up_in_one_line(tmp_path: Path):
    # A managed Redis may rename or disable commands. Without SCRIPT the server started (its
    # check asked only EVALSHA), and then refused every resumable reply with a 503 quoting
    # its write script's source, as Redis echoed the refused SCRIPT LOAD.
    with redis_server(tmp_path, "--rename-command", "SCRIPT", "") as server:
        done = serve(f"redis://127.0.0.1:{server.port}/0")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "refuses this server's commands: unknown command 'SCRIPT'" in lines[0], lines[0]
    assert "cjson" not in lines[0], lines[0]


async def test_a_user_the_redis_takes_serves_its_database(acl_redis: RedisServer):
    url = f"redis://alice:{QUOTED}@127.0.0.1:{acl_redis.port}/4"
    async with replica("--engine", "simulated", "--redis-url", url):
        pass


async def test_a_redis_not_reachable_yet_is_told_and_the_server_serves(tmp_path: Path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    async with replica("--engine", "simulated", "--redis-url", url) as (_, base):
        assert base.startswith("http://")


async def test_a_sentinel_that_cannot_be_asked_is_named_by_its_address(tmp_path: Path):
    """redis-py names each Sentinel it could not ask by its client's whole repr (a screenful
    of pool and connection settings), which reached clients' error messages and the log."""
    with redis_server(tmp_path) as not_a_sentinel:  # answers SENTINEL with an error
        url = f"redis+sentinel://:pw@127.0.0.1:{not_a_sentinel.port}/svc"
        store = RedisReplayStore(url, failover_s=0.0)
        try:
            with pytest.raises(StoreUnavailable) as caught:
                await store.info("r1")
            contact = await store.first_contact()
        finally:
            await store.aclose()
    said = caught.value.describe()
    assert f"No master found for 'svc' : Sentinel 127.0.0.1:{not_a_sentinel.port} - " in said
    assert "redis.asyncio" not in said and "socket_timeout" not in said, said
    assert contact is not None and not contact.refused
    assert "redis.asyncio" not in contact.why, contact.why


def test_a_cluster_that_refuses_the_password_stops_start_up(tmp_path: Path):
    node = RedisServer(tmp_path, cluster=True)
    node.start()
    try:
        admin = redis.Redis(port=node.port)
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")  # type: ignore[no-untyped-call]
        admin.config_set("requirepass", "rightpw")
        admin.close()
        done = serve(f"redis+cluster://:wrongpw@127.0.0.1:{node.port}")
    finally:
        node.stop()
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"replystream serve: --redis-url: Redis at redis+cluster://127.0.0.1:{node.port} refuses"
    ), lines[0]
    assert "invalid username-password pair" in lines[0] and "pw" not in lines[0]
