import asyncio
import re

from replystream.delivery.replay import MemoryReplayStore
from replystream.engine.simulated import SimulatedConfig, SimulatedEngine
from replystream.engine.tiny import load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from replystream.server.state import add_state_gauges
from tests.conftest import wait_for
from tests.rawhttp import raw_request


def gauge(metrics: bytes, name: str) -> float:
    found = re.search(rb"^%s ([0-9.e+-]+)$" % name.encode(), metrics, re.MULTILINE)
    assert found, name
    return float(found.group(1))


async def test_state_gauges_return_to_zero_after_a_reply_is_abandoned():
    engine = load_default_engine(TinyEngineConfig(num_blocks=64))
    app = create_app(engine)
    add_state_gauges(app)
    async with running(app) as url:
        response = await raw_request(f"{url}/stream?max_tokens=200")
        await response.reader.readuntil(b"\n\n")  # the reply event
        await response.reader.readuntil(b"\n\n")  # the first token
        during = await (await raw_request(f"{url}/metrics")).read_body()
        await response.aclose()
        await wait_for(lambda: engine.stats().active == 0)
        after = await (await raw_request(f"{url}/metrics")).read_body()
    assert gauge(during, "replystream_kv_blocks_used") > 0
    assert gauge(during, "replystream_kv_blocks") == 64
    assert gauge(during, "replystream_engine_requests_running") == 1
    assert gauge(during, "replystream_engine_requests_waiting") == 0
    assert gauge(during, "replystream_replies_in_flight") == 1
    assert gauge(during, "replystream_active_streams") == 1  # read when scraped
    assert gauge(after, "replystream_kv_blocks_used") == 0
    assert gauge(after, "replystream_replies_in_flight") == 0
    assert gauge(after, "replystream_active_streams") == 0
    assert gauge(after, "replystream_open_readers") == 0
    assert gauge(after, 'replystream_reply_logs{store="local"}') == 0
    assert gauge(after, "replystream_open_tasks") >= 1
    assert gauge(after, "replystream_open_fds") > 0


async def test_reply_logs_gauge_drops_logs_that_expired_while_the_server_was_quiet():
    # Expired logs used to go only when touched or every 256 new replies: a server gone quiet
    # kept reporting (and holding) every reply of its last minutes.
    store = MemoryReplayStore(ttl_after_end_s=0.3)
    app = create_app(SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0)), store=store)
    add_state_gauges(app)
    async with running(app) as url:
        for _ in range(3):
            await (await raw_request(f"{url}/stream?max_tokens=2&resumable=1")).read_body()
        ended = await (await raw_request(f"{url}/metrics")).read_body()
        await asyncio.sleep(0.5)
        expired = await (await raw_request(f"{url}/metrics")).read_body()
    assert gauge(ended, 'replystream_reply_logs{store="resumable"}') == 3
    assert gauge(expired, 'replystream_reply_logs{store="resumable"}') == 0


async def test_a_pool_too_small_for_the_load_shows_its_preemptions_and_recomputed_tokens():
    """Four 60-token replies on a 10-block pool: the engine preempts to make room, and the
    gauges say how often and what it cost, as its scheduler counted them."""
    engine = load_default_engine(TinyEngineConfig(num_blocks=10, block_size=16))
    app = create_app(engine)
    add_state_gauges(app)
    async with running(app) as url:
        idle = await (await raw_request(f"{url}/metrics")).read_body()

        async def whole_reply(seed: int) -> bytes:
            return await (await raw_request(f"{url}/stream?max_tokens=60&seed={seed}")).read_body()

        await asyncio.gather(*(whole_reply(seed) for seed in range(4)))
        await wait_for(lambda: engine.stats().active == 0)
        after = await (await raw_request(f"{url}/metrics")).read_body()
    counted = engine.scheduler_stats()
    assert gauge(idle, "replystream_engine_preemptions") == 0
    assert gauge(after, "replystream_engine_preemptions") == counted.preemptions > 0
    assert gauge(after, "replystream_engine_recomputed_tokens") == counted.recomputed > 0
    assert gauge(after, "replystream_engine_requests_waiting") == 0
