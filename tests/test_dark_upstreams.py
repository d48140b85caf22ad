"""An upstream on a network of its own (a veth pair into a namespace, ``tests/netns.py``) that
goes dark: every packet dropped, no FIN, no reset, as behind a partition or a load balancer
that forgot the flow. The relay must give up on it within its documented bounds, serve the
request at another upstream, and let go of what it held for the dark one.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.chat_upstream import CountingUpstream
from tests.conftest import wait_for
from tests.netns import Namespace, client_namespace
from tests.processes import ready_url, stop

HEAD_S = 2.0  # the relay's --upstream-timeout-s and --upstream-ttft-s here
PROBE_S = 0.5  # its --upstream-health-s (a probe then waits this long at most)


async def upstream_inside(ns: Namespace) -> tuple[asyncio.subprocess.Process, str]:
    """``replystream serve`` as an upstream serving model ``m``, inside ``ns``."""
    process = await asyncio.create_subprocess_exec(
        *ns.inside, sys.executable, "-m", "replystream", "serve",
        "--host", ns.client_ip, "--port", "0",
        "--engine", "simulated", "--model-name", "m", "--delay-ms", "1", "--tokens", "3",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        return process, await ready_url(process)
    except BaseException:
        await stop(process)
        raise


def sockets_to(url: str) -> int:
    """How many TCP sockets this process holds open to ``url``'s host and port (the kernel's
    table of its network, matched to the inodes of this process's descriptors)."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    # /proc/net/tcp writes an IPv4 address as the hex of its bytes in host (little) order.
    remote = f"{socket.inet_aton(parts.hostname)[::-1].hex().upper()}:{parts.port:04X}"
    with open("/proc/self/net/tcp") as table:
        rows = [line.split() for line in list(table)[1:]]
    return sum(1 for row in rows if row[2] == remote and row[9] in inodes)


class DarkSide:
    """An upstream inside a namespace of its own (``url``), whose packets a test drops and
    lets through again, and the relay engine the test puts over it."""

    def __init__(self, ns: Namespace, url: str) -> None:
        self.ns, self.url = ns, url
        self.engine: UpstreamEngine | None = None
        self.dark = False

    async def blackout(self) -> None:
        await self.ns.blackout()
        self.dark = True

    async def restore(self) -> None:
        await self.ns.restore()
        self.dark = False


@contextlib.asynccontextmanager
async def an_upstream_to_darken() -> AsyncIterator[DarkSide]:
    """A ``DarkSide``, let go of in order however the test ends: the engine, the dropped
    packets, the upstream's process."""
    with client_namespace() as ns:
        process, url = await upstream_inside(ns)
        side = DarkSide(ns, url)
        try:
            yield side
        finally:
            try:
                if side.engine is not None:
                    await side.engine.aclose()
                if side.dark:
                    await ns.restore()
            finally:
                await stop(process)


async def test_a_request_given_up_on_a_dark_upstream_lets_go_of_its_connection():
    # A kept-alive connection to an upstream that has since gone dark takes a request whose
    # body the kernel cannot send (nothing is acknowledged). The relay gives up on it after
    # its head timeout and the next upstream answers; but closing that connection waited
    # to send the rest of the body first, so the socket (and the body, megabytes) stayed
    # held until the kernel gave up, about 15 minutes later, and a network that healed
    # meanwhile would have delivered the request, for a reply nobody reads.
    healthy = CountingUpstream()
    async with an_upstream_to_darken() as side, running(healthy.app()) as healthy_url:
        dark_url = side.url
        side.engine = engine = UpstreamEngine(
            UpstreamConfig(
                # The dark one first (weights 100 and 1): each request tries it.
                (
                    UpstreamTarget(f"{dark_url}/v1", 100),
                    UpstreamTarget(f"{healthy_url}/v1", 1),
                ),
                model="m",
                headers_timeout_s=HEAD_S,
                ttft_s=HEAD_S,
                health_s=600.0,
            )
        )
        config = ServerConfig(max_body_bytes=8 << 20, max_prompt_chars=4 << 20)
        async with (
            running(create_app(engine, config)) as url,
            aiohttp.ClientSession() as session,
        ):
            async with session.post(f"{url}/v1/replies", json={"prompt": "x"}) as reply:
                assert reply.status == 200 and b"event: done" in await reply.read()
            # Kept alive for the next request (beside the health probes' own).
            held = sockets_to(dark_url)
            assert held >= 1
            await side.blackout()
            prompt = "word " * 400_000  # 2 MB: far more than a socket's buffer takes
            big = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
            async with session.post(
                f"{url}/v1/replies",
                data=io.BytesIO(big),  # (aiohttp's way for a large body)
                headers={"Content-Type": "application/json"},
            ) as reply:
                body = await reply.read()
            assert reply.status == 200 and b"sunny" in body, body[-300:]
            assert healthy.chats == 1
            # Given up on (the head timeout passed): its connection goes with it.
            await wait_for(lambda: sockets_to(dark_url) == held - 1, timeout_s=HEAD_S)


def told(caplog: pytest.LogCaptureFixture, about: str) -> list[str]:
    """The relay's log lines that name ``about``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "replystream.upstream" and about in r.getMessage()
    ]


async def test_an_upstream_gone_dark_is_logged_once_and_once_more_when_it_answers(
    caplog: pytest.LogCaptureFixture,
):
    # Requests fail over from an upstream whose health probes fail, and at the default log
    # level (attempts are INFO lines) nothing said so: an upstream gone dark, down or
    # refusing the probe was out of routing without a word. Now one line as its probes
    # begin to fail, one as one answers again, and none for each probe in between.
    caplog.set_level(logging.WARNING, logger="replystream.upstream")
    healthy = CountingUpstream()
    async with an_upstream_to_darken() as side, running(healthy.app()) as healthy_url:
        dark_url = side.url
        targets = (UpstreamTarget(f"{dark_url}/v1"), UpstreamTarget(f"{healthy_url}/v1"))
        side.engine = engine = UpstreamEngine(UpstreamConfig(targets, model="m", health_s=PROBE_S))
        async with running(create_app(engine)) as url, aiohttp.ClientSession() as session:
            async with session.get(f"{url}/healthz") as health:  # the first probes
                assert health.status == 200
            backend = next(b for b in engine.pool.backends if b.name == f"{dark_url}/v1")
            assert backend.probe_ok and not told(caplog, dark_url)
            await side.blackout()
            await wait_for(lambda: backend.probes["failed"] >= 4, timeout_s=10 * PROBE_S)
            assert len(told(caplog, dark_url)) == 1, told(caplog, dark_url)
            await side.restore()
            await wait_for(lambda: len(told(caplog, dark_url)) == 2, timeout_s=10 * PROBE_S)
            async with session.post(f"{url}/v1/replies", json={"prompt": "x"}) as reply:
                assert reply.status == 200
    began, ended = told(caplog, dark_url)
    assert began.startswith(f"health probe: the upstream at {dark_url}/v1 did not answer"), began
    assert "told again once one answers" in began
    assert ended.startswith(f"the upstream at {dark_url}/v1 answers its health probe again"), ended
