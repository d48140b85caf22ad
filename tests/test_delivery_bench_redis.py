"""The delivery benchmark's Redis-backed servers: a fresh Redis (and nginx for two replicas)
started for the run, the same token bytes as every other server, and the tier's CPU and
memory measured beside the replicas'. Real processes on loopback ports, scaled down."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DELIVERY = Path(__file__).resolve().parent.parent / "benchmarks" / "delivery"
sys.path.insert(0, str(DELIVERY))

from report import table  # noqa: E402
from run import measure  # noqa: E402
from servers import started_server  # noqa: E402

from tests.services import require_binary  # noqa: E402


@pytest.mark.parametrize("name", ["replystream-redis", "replystream-redis-2"])
async def test_a_redis_backed_run_measures_the_replicas_redis_and_nginx(name: str):
    require_binary("redis-server", "redis-server")
    require_binary("nginx")
    async with started_server(name) as server:
        assert server.redis is not None
        replicas = 2 if name.endswith("-2") else 1
        assert len(server.replicas) == replicas
        assert (server.proxy_pid is not None) == (replicas == 2)
        result = await measure(server, "sse", 12, timeout_s=60.0, quiet_s=0)
    client = result["client"]
    assert client["completed"] == 12 and client["failed"] == 0
    assert result["processes"] == replicas
    # Every reply's log went to Redis and is kept there: memory grew, Redis worked.
    assert result["redis_memory_bytes"] > 12 * 1024
    assert result["redis_cpu_s"] is not None and result["redis_us_per_event"] >= 0
    assert (result["proxy_cpu_s"] is not None) == (replicas == 2)
    run = {"server": name, "name": name, "transport": "sse", **result}
    printed = table([run], [name], [12])
    assert "| Redis memory / reply logged (KiB) |" in printed
