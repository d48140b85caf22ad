"""Varnish in front of the real server: its defaults stream but refuse the WebSocket upgrade,
its gzip holding the whole reply is named, docs/deploy/varnish.vcl streams, passes the
WebSocket transport on and cancels a reply whose client left, and the keep-alives hold a
silent stream past the pipe's idle timeout."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from urllib.parse import urlsplit

from replystream.client import measure_reply
from replystream.server import create_app, running
from tests.proxies import (
    DEPLOY,
    assert_keepalives_hold_a_silent_prefill,
    doctor,
    leave_during_prefill,
    long_reply_engine,
    running_varnish,
    substituted,
    websocket_reply,
)
from tests.services import free_port


def backend_only(app_url: str, more: str = "") -> str:
    """A VCL naming the app as its one backend (as `varnishd -b` does), and ``more``."""
    port = urlsplit(app_url).port
    return f'vcl 4.1;\nbackend app {{ .host = "127.0.0.1"; .port = "{port}"; }}\n{more}\n'


def deploy_vcl(app_url: str) -> str:
    """docs/deploy/varnish.vcl with the app's port substituted."""
    text = (DEPLOY / "varnish.vcl").read_text()
    return substituted(text, [(r'\.port = "8000";', f'.port = "{urlsplit(app_url).port}";')])


async def test_defaults_stream_but_refuse_the_websocket_upgrade(tmp_path):
    async with running(create_app(long_reply_engine())) as app_url:
        port = free_port()
        async with running_varnish(backend_only(app_url), port, tmp_path) as url:
            stream, ws = await asyncio.gather(doctor(url), websocket_reply(url))
    assert stream.verdict == "streaming", stream.reason
    assert ws == "refused 400"  # fetched without its Upgrade: the VCL must pipe it


async def test_its_gzip_holds_the_whole_reply_and_is_named(tmp_path):
    gzip = "sub vcl_backend_response { set beresp.do_gzip = true; }"
    async with running(create_app(long_reply_engine())) as app_url:
        port = free_port()
        async with running_varnish(backend_only(app_url, gzip), port, tmp_path) as url:
            result = await doctor(url)
    assert result.verdict == "compressed", result.reason
    assert "buffered" in result.reason  # all of it at the end
    assert result.hop is not None and result.hop.startswith("Varnish's gzip (beresp.do_gzip)")
    assert result.fix is not None and "beresp.do_gzip" in result.fix


async def test_streaming_turned_off_is_named(tmp_path):
    held = "sub vcl_backend_response { set beresp.do_stream = false; }"
    async with running(create_app(long_reply_engine())) as app_url:
        port = free_port()
        async with running_varnish(backend_only(app_url, held), port, tmp_path) as url:
            result = await doctor(url)
    assert result.verdict == "buffered", result.reason
    assert result.hop is not None and "beresp.do_stream = false" in result.hop


async def test_deploy_config_streams_and_passes_the_websocket_on(tmp_path):
    async with running(create_app(long_reply_engine())) as app_url:
        port = free_port()
        async with running_varnish(deploy_vcl(app_url), port, tmp_path) as url:
            stream, ws = await asyncio.gather(doctor(url), websocket_reply(url))
            body = {"model": "simulated", "input": "hi", "stream": True, "max_output_tokens": 50}
            responses = await measure_reply(f"{url}/v1/responses", method="POST", json_body=body)
    assert stream.verdict == "streaming", stream.reason
    assert ws == "done"
    assert responses.complete and responses.tokens == 50, responses.error


async def test_a_client_that_leaves_during_prefill_cancels_at_once_through_the_pipe(tmp_path):
    # Fetched (the defaults), a stream whose client left is noticed only when keep-alive
    # writes to it fail, some 45 s at 15 s each; piped (the deploy config), at once.
    engine = long_reply_engine(first_token_ms=20_000.0)
    async with running(create_app(engine)) as app_url:
        port = free_port()
        async with running_varnish(backend_only(app_url), port, tmp_path) as url:
            defaults = await leave_during_prefill(url, engine, limit_s=3.0)
        port = free_port()
        async with running_varnish(deploy_vcl(app_url), port, tmp_path / "deploy") as url:
            deployed = await leave_during_prefill(url, engine, limit_s=10.0)
    assert defaults >= 3.0
    assert deployed < 2.0


async def test_keepalives_hold_a_silent_stream_past_the_pipe_timeout(tmp_path):
    # pipe_timeout at 2 s, keep-alives every 0.5 s: a 5 s prefill streams through; without
    # keep-alives Varnish closes the silent pipe.
    def varnish(app_url: str, port: int, tmp: Path) -> AbstractAsyncContextManager[str]:
        return running_varnish(deploy_vcl(app_url), port, tmp, params=["pipe_timeout=2"])

    await assert_keepalives_hold_a_silent_prefill(varnish, tmp_path)
