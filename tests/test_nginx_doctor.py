"""The doctor names the buffering hop correctly through a real nginx in front of a real server.

Each test starts the replystream app on a loopback port and nginx in front of it, then asks for
one 400-token reply at 10 ms per token (about 9 KiB of events), long enough for the verdicts to
separate clearly. Verdicts and their evidence are checked, never tight timings.
"""

from __future__ import annotations

import asyncio
import json
import sys
import zlib
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from replystream.client import measure_reply
from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.engine.simulated import DEFAULT_REPLY, reply_of_length
from replystream.lab.diagnosis import Diagnosis, Thresholds, diagnose
from replystream.server import running
from tests.conftest import serve_engine
from tests.nginx import LOCATIONS, deploy_config, proxy_config, running_nginx
from tests.processes import replica
from tests.services import free_port
from tests.test_doctor_compare import ROUTE, bursty, chunk

TOKENS = 400


def long_reply_engine() -> SimulatedEngine:
    text = reply_of_length(DEFAULT_REPLY, TOKENS)
    return SimulatedEngine(SimulatedConfig(reply_text=text, delay_ms=10.0, jitter_ms=2.0))


@pytest.fixture
async def app_url() -> AsyncIterator[str]:
    async with serve_engine(long_reply_engine()) as url:
        yield url


def upstream_of(url: str) -> str:
    return urlsplit(url).netloc


async def doctor(url: str) -> Diagnosis:
    timing = await measure_reply(f"{url}/stream?max_tokens={TOKENS}", timeout_s=60)
    return diagnose(timing, Thresholds())


async def test_direct_path_streams(app_url):
    result = await doctor(app_url)
    assert result.verdict == "streaming", result.reason
    assert result.events == TOKENS
    assert result.headers["x-accel-buffering"] == "no"
    assert result.median_gap_ms is not None and result.median_gap_ms > 3.0
    assert result.hop is None


async def test_default_proxy_buffering_arrives_in_buffer_sized_bursts(app_url, tmp_path):
    port = free_port()
    config = proxy_config(upstream_of(app_url), port, LOCATIONS["buffering_on"])
    async with running_nginx(config, port, tmp_path) as proxy:
        result = await doctor(proxy)
    assert result.verdict == "bursty", result.reason
    assert len(result.bursts) >= 2
    assert sum(b.events for b in result.bursts) == TOKENS
    # Every full burst is one 4 KiB buffer of events; the text came long after the first byte
    # could have been sent.
    assert all(3000 <= b.approx_bytes <= 4600 for b in result.bursts[:-1])
    assert result.hop is not None and "nginx proxy buffering" in result.hop
    assert result.fix is not None and "proxy_buffering off" in result.fix
    assert result.first_text_ms is not None and result.first_text_ms > 1000


async def test_a_responses_streams_bursts_are_the_bytes_of_one_buffer(app_url, tmp_path):
    # Its closing events repeat the whole reply (output_text.done, content_part.done,
    # output_item.done, response.completed): no full burst may be swollen by them.
    body = {"model": "simulated", "input": "hi", "stream": True, "max_output_tokens": TOKENS}
    port = free_port()
    config = proxy_config(upstream_of(app_url), port, LOCATIONS["buffering_on"])
    async with running_nginx(config, port, tmp_path) as proxy:
        timing = await measure_reply(
            f"{proxy}/v1/responses", method="POST", json_body=body, timeout_s=60
        )
    result = diagnose(timing, Thresholds())
    assert result.verdict == "bursty", result.reason
    assert sum(b.events for b in result.bursts) == TOKENS
    # Each full burst is nginx's 4 KiB buffer, or a few of them on a machine too busy to
    # read them apart; never more bytes than the buffers hold.
    for burst in result.bursts[:-1]:
        buffers = max(1, round(burst.approx_bytes / 4096))
        assert 3000 * buffers <= burst.approx_bytes <= 4096 * buffers, result.bursts
    assert sum(b.approx_bytes for b in result.bursts) <= timing.body_bytes
    assert result.hop is not None and "bursts of about 4 KiB" in result.hop


async def test_buffers_larger_than_the_reply_deliver_it_all_at_the_end(app_url, tmp_path):
    port = free_port()
    config = proxy_config(upstream_of(app_url), port, LOCATIONS["large_buffers"])
    async with running_nginx(config, port, tmp_path) as proxy:
        result = await doctor(proxy)
    assert result.verdict == "buffered", result.reason
    assert result.first_text_ms is not None and result.last_text_ms is not None
    assert result.last_text_ms - result.first_text_ms < 0.1 * result.last_text_ms


async def test_proxy_buffering_off_streams(app_url, tmp_path):
    port = free_port()
    config = proxy_config(upstream_of(app_url), port, LOCATIONS["buffering_off"])
    async with running_nginx(config, port, tmp_path) as proxy:
        result = await doctor(proxy)
    assert result.verdict == "streaming", result.reason
    assert result.events == TOKENS


async def test_honoured_x_accel_buffering_streams_with_buffering_on(app_url, tmp_path):
    port = free_port()
    config = proxy_config(upstream_of(app_url), port, LOCATIONS["accel_honoured"])
    async with running_nginx(config, port, tmp_path) as proxy:
        result = await doctor(proxy)
    assert result.verdict == "streaming", result.reason


async def test_gzip_on_an_unbuffered_event_stream_flushes_every_event_and_streams(
    app_url, tmp_path
):
    # With proxy buffering off nginx flushes its gzip after every read from the app: each
    # event arrives compressed, on time. Nothing holds the stream, so nothing is to fix.
    port = free_port()
    config = proxy_config(upstream_of(app_url), port, LOCATIONS["gzip"])
    async with running_nginx(config, port, tmp_path) as proxy:
        result = await doctor(proxy)
    assert result.verdict == "streaming", result.reason
    assert result.headers["content-encoding"] == "gzip"
    assert "compressed (gzip) and flushed after every event" in result.reason
    assert result.events == TOKENS  # the client still decoded every event


async def test_gzip_over_proxy_buffering_names_both_hops_and_both_fixes(app_url, tmp_path):
    """Turning compression off alone would leave this stream held in nginx's buffers."""
    port = free_port()
    location = f"{LOCATIONS['large_buffers']} gzip on; gzip_types text/event-stream;"
    config = proxy_config(upstream_of(app_url), port, location)
    async with running_nginx(config, port, tmp_path) as proxy:
        result = await doctor(proxy)
    assert result.verdict == "compressed", result.reason
    assert "and buffered" in result.reason, result.reason
    assert result.hop is not None and "nginx gzip" in result.hop
    assert "nginx proxy buffering" in result.hop
    assert result.fix is not None and "gzip_types" in result.fix
    assert "proxy_buffering off" in result.fix


async def test_deploy_config_streams_events_and_compresses_json(app_url, tmp_path):
    port = free_port()
    native_body = {"prompt": "hello", "max_tokens": 100}
    async with running_nginx(deploy_config(app_url, port), port, tmp_path) as proxy:
        stream, native, wait = await asyncio.gather(
            doctor(proxy),
            measure_reply(f"{proxy}/v1/replies", method="POST", json_body=native_body),
            measure_reply(f"{proxy}/wait?max_tokens=40", timeout_s=30),
        )
    assert stream.verdict == "streaming", stream.reason
    assert "content-encoding" not in stream.headers
    # Not held by nginx. On a loaded machine this process's loop (the server's and the three
    # clients') can stall past a token's 10 ms, and the server then writes the tokens due in
    # one turn: small bursts, never a proxy buffer's fill (4 KiB at the least, nginx's page).
    native_seen = diagnose(native)
    largest = max((burst.approx_bytes for burst in native_seen.bursts), default=0)
    assert native_seen.verdict == "streaming" or (
        native_seen.verdict == "bursty" and largest < 2048
    ), native_seen.reason
    assert wait.complete and wait.headers.get("content-encoding") == "gzip"


async def test_deploy_config_waits_for_a_buffered_reply_longer_than_nginxs_default(tmp_path):
    # A buffered reply (/wait) sends nothing until it is whole: a minute of generation is
    # a minute of silence, past nginx's default proxy_read_timeout (60 s), which answers 504.
    # Here an http-level 2 s stands in for that default (a location that sets none inherits
    # it) and the reply takes about 4 s.
    schedule = ("--engine", "simulated", "--delay-ms", "40", "--jitter-ms", "0", "--tokens", "100")
    async with replica(*schedule) as (_, app_url):
        port = free_port()
        config = "proxy_read_timeout 2s;\n" + deploy_config(app_url, port)
        async with running_nginx(config, port, tmp_path) as proxy:
            wait = await measure_reply(f"{proxy}/wait?max_tokens=100", timeout_s=60)
    assert wait.status == 200 and wait.complete, (wait.status, wait.error)
    assert wait.last_text_ms is not None and wait.last_text_ms > 2500


async def ws_reply_from(address: str, proxy: str, spoofed_for: str | None = None) -> str:
    """Open /v1/ws from ``address`` through ``proxy``, run one reply, return how it ended."""
    headers = {"X-Forwarded-For": spoofed_for} if spoofed_for else {}
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with aiohttp.ClientSession(connector=connector) as http:
        try:
            ws = await http.ws_connect(f"{proxy}/v1/ws", headers=headers)
        except aiohttp.WSServerHandshakeError as exc:
            return f"refused {exc.status}"
        async with ws:
            await ws.send_json({"type": "reply", "id": "q", "prompt": "Hi"})
            while True:
                message = await ws.receive_json(timeout=30)
                if message["type"] in ("done", "error"):
                    return str(message["type"])


async def test_deploy_config_names_each_websocket_client_to_the_app(tmp_path):
    # The app trusts nginx's X-Forwarded-For (--trusted-proxy), as the config's comment says
    # to run it. On /v1/ws too, nginx must set that header from the client's address: else
    # every WebSocket client is nginx's one address, sharing one client's limits, and a
    # header the client sent itself reaches the app as if nginx had written it.
    schedule = ("--engine", "simulated", "--delay-ms", "25", "--jitter-ms", "0", "--tokens", "40")
    guard = ("--trusted-proxy", "127.0.0.1", "--max-concurrent-per-client", "1")
    async with replica(*schedule, *guard) as (_, app_url):
        port = free_port()
        async with running_nginx(deploy_config(app_url, port), port, tmp_path) as proxy:
            two_clients = await asyncio.gather(
                ws_reply_from("127.0.0.2", proxy), ws_reply_from("127.0.0.3", proxy)
            )
            one_posing_as_the_other = await asyncio.gather(
                ws_reply_from("127.0.0.2", proxy),
                ws_reply_from("127.0.0.3", proxy, spoofed_for="127.0.0.2"),
            )
    assert list(two_clients) == ["done", "done"]
    assert list(one_posing_as_the_other) == ["done", "done"]


async def run_cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replystream",
        *args,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode()


async def test_cli_compares_direct_and_proxied_paths_and_fails_ci(app_url, tmp_path):
    port = free_port()
    config = proxy_config(upstream_of(app_url), port, LOCATIONS["buffering_on"])
    query = f"/stream?max_tokens={TOKENS}"
    async with running_nginx(config, port, tmp_path) as proxy:
        code, out = await run_cli("doctor", proxy + query, "--direct", app_url + query, "--json")
    result = json.loads(out)
    assert code == 1
    assert result["verdict"] == "bursty"
    for key in ("first_byte_ms", "first_text_ms", "events", "gaps_ms", "median_gap_ms"):
        assert key in result
    assert result["direct"]["verdict"] == "streaming"
    assert "the app streams" in result["comparison"]
    assert result["first_text_ms"] > result["direct"]["first_text_ms"]


async def test_cli_exits_zero_when_the_stream_streams(app_url):
    # The whole 4 s reply, not a short one: a median gap over a fraction of a second can be
    # a moment the test machine starved this server of its core.
    code, out = await run_cli("doctor", f"{app_url}/stream?max_tokens={TOKENS}")
    assert code == 0, out
    assert "STREAMING" in out


async def test_cli_reports_failed_for_a_server_that_is_not_there():
    code, out = await run_cli("doctor", f"http://127.0.0.1:{free_port()}/stream", "--json")
    assert code == 1
    assert json.loads(out)["verdict"] == "failed"


async def test_a_fast_engine_streams_directly_and_is_still_caught_behind_a_buffer(tmp_path):
    # A fast engine: a token every 2 ms, on a timer (the tiny engine's token time is the
    # machine's, 1-3 ms). Text events 2 ms apart are a healthy stream, not a burst; the same
    # engine behind nginx's 4 KiB buffers is held.
    fast = ("--engine", "simulated", "--delay-ms", "2", "--jitter-ms", "0", "--tokens", "250")
    async with replica(*fast) as (_, app):
        query = "/stream?max_tokens=250"
        code, out = await run_cli("doctor", app + query, "--json")
        direct = json.loads(out)
        assert (code, direct["verdict"]) == (0, "streaming"), direct["reason"]
        assert direct["median_gap_ms"] < 3.0  # faster than the old fixed 3 ms "burst" gap
        port = free_port()
        config = proxy_config(upstream_of(app), port, LOCATIONS["buffering_on"])
        async with running_nginx(config, port, tmp_path) as proxy:
            code, out = await run_cli("doctor", proxy + query, "--direct", app + query, "--json")
    proxied = json.loads(out)
    assert code == 1
    assert proxied["verdict"] in ("bursty", "buffered"), proxied["reason"]
    assert proxied["hop"] is not None and "nginx proxy buffering" in proxied["hop"]
    assert proxied["direct"]["verdict"] == "streaming"
    assert "the app streams" in proxied["comparison"]


def gzipping_app() -> web.Application:
    """An app whose own middleware gzips its event stream without flushing (as a compressor
    that waits for enough bytes does): 100 chat chunks 5 ms apart, held until the end."""

    async def completions(request: web.Request) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "Content-Encoding": "gzip"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
        for i in range(100):
            await asyncio.sleep(0.005)
            if held := compressor.compress(chunk(f"w{i} ")):
                await response.write(held)
        await response.write(compressor.compress(b"data: [DONE]\n\n") + compressor.flush())
        return response

    app = web.Application()
    app.router.add_post(ROUTE, completions)
    return app


@pytest.mark.parametrize(
    ("app", "verdict"), [(bursty, "bursty"), (gzipping_app, "compressed")], ids=["held", "gzipped"]
)
async def test_an_app_that_holds_its_own_stream_is_named_not_the_nginx_in_front(
    tmp_path, app: Callable[[], web.Application], verdict: str
):
    # nginx streams here (proxy_buffering off, no gzip): only its Server header is there.
    async with running(app()) as app_url:
        port = free_port()
        config = proxy_config(upstream_of(app_url), port, LOCATIONS["buffering_off"])
        async with running_nginx(config, port, tmp_path) as proxy:
            code, out = await run_cli(
                "doctor", proxy + ROUTE, "--direct", app_url + ROUTE, "--model", "m", "--json"
            )
    result = json.loads(out)
    assert code == 1
    assert result["headers"]["server"].startswith("nginx")
    assert (result["verdict"], result["direct"]["verdict"]) == (verdict, verdict), result
    for judged in (result, result["direct"]):
        assert judged["hop"].startswith("the app"), judged["hop"]
        assert "between the app and this client" not in judged["hop"], judged["hop"]
        assert "nginx" not in judged["hop"] and "proxy_buffering" not in judged["fix"], judged
    assert "the app itself is already" in result["comparison"]
