"""A relay in front of an https upstream whose certificate a private CA signed: verified
against the CAs ``SSL_CERT_FILE`` names (OpenSSL's own variable, which the relay's requests
and its health probes both read), and refused, with words that say why, against the system's
CAs alone. The upstream is a small aiohttp app serving TLS on loopback, its certificate for
``localhost``; the relay a ``replystream serve`` process."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web

from tests.processes import launch, ready_url, stop
from tests.services import free_port
from tests.sse_client import post_events
from tests.test_bench_tls import make_certificates
from tests.test_upstream_routing import Upstream

ASK = {"messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def https_upstream(cert: Path, key: Path) -> AsyncIterator[str]:
    """``Upstream`` over TLS on loopback; its base URL, by the name its certificate holds."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    runner = web.AppRunner(Upstream(["m"]).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield f"https://localhost:{port}/v1"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def relay_process(upstream: str, env: dict[str, str]) -> AsyncIterator[str]:
    process = await launch("--engine", f"upstream:{upstream}", "--log-level", "WARNING", env=env)
    try:
        yield await ready_url(process, 30.0)
    finally:
        await stop(process)


async def test_an_upstream_signed_by_a_private_ca_is_verified_against_ssl_cert_file(
    tmp_path: Path,
):
    ca, cert, key = make_certificates(tmp_path / "certs")
    env = {name: value for name, value in os.environ.items() if name != "SSL_CERT_FILE"}
    async with https_upstream(cert, key) as upstream:
        async with relay_process(upstream, {**env, "SSL_CERT_FILE": str(ca)}) as url:
            trusted = await post_events(f"{url}/v1/chat/completions", ASK)
        async with relay_process(upstream, env) as url:
            untrusted = await post_events(f"{url}/v1/chat/completions", ASK)
    assert trusted.status == 200, trusted.raw
    assert json.loads(trusted.raw)["choices"][0]["message"]["content"] == "w0 w1 w2 "
    assert untrusted.status == 502, untrusted.raw
    error = json.loads(untrusted.raw)["error"]
    assert error["code"] == "upstream_tls" and "certificate is not trusted" in error["message"]
