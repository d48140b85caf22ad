"""Per-client limits behind a proxy: ``--trusted-proxy`` reads ``X-Forwarded-For`` from listed
proxies only.

Clients are told apart by their source address: every 127.x.y.z is loopback on Linux, so a
test client binds 127.0.0.2 or 127.0.0.3 before it connects. The app listens on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig, parse_trusted_proxies
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.nginx import deploy_config, running_nginx
from tests.services import free_port

PER_MINUTE = 2


async def status_from(source: str, url: str, forwarded_for: str | None = None) -> int:
    """GET ``url`` from the local address ``source``; the response's status."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(
        parts.hostname, parts.port, local_addr=(source, 0)
    )
    head = [f"GET {parts.path}?{parts.query} HTTP/1.1", f"Host: {parts.netloc}"]
    head.append("Connection: close")
    if forwarded_for is not None:
        head.append(f"X-Forwarded-For: {forwarded_for}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    await reader.read()  # the whole reply: the request has ended on the server too
    writer.close()
    return status


def serve(trusted: str):
    guard = GuardConfig(per_minute=PER_MINUTE, trusted_proxies=parse_trusted_proxies([trusted]))
    return running(create_app(fast_engine(), ServerConfig(guard=guard)))


async def test_clients_behind_a_trusted_proxy_get_a_bucket_each(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="replystream.access")
    async with serve("127.0.0.1") as url:
        stream = f"{url}/stream?max_tokens=2"
        # The proxy (peer 127.0.0.1) appends the address it served to what the client sent.
        alice = [await status_from("127.0.0.1", stream, "10.9.9.9, 203.0.113.1") for _ in range(3)]
        bob = await status_from("127.0.0.1", stream, "203.0.113.2")
    assert alice == [200, 200, 429]
    assert bob == 200
    clients = [json.loads(r.getMessage())["client"] for r in caplog.records]
    assert clients == ["203.0.113.1"] * 3 + ["203.0.113.2"]


@pytest.mark.parametrize(
    ("alice", "bob"),
    [("203.0.113.1:5678", "203.0.113.2:5678"), ("[2001:db8::1]:4711", "[2001:db8::2]")],
)
async def test_an_entry_with_the_port_a_proxy_was_connected_from_names_its_client(
    alice: str, bob: str
):
    # Such an entry stopped the walk, and every client behind that proxy shared its bucket.
    async with serve("127.0.0.1") as url:
        stream = f"{url}/stream?max_tokens=2"
        from_alice = [
            await status_from("127.0.0.1", stream, f"10.9.9.9, {alice}") for _ in range(3)
        ]
        from_bob = await status_from("127.0.0.1", stream, bob)
    assert from_alice == [200, 200, 429]
    assert from_bob == 200


def dual_stack() -> bool:
    """Whether a socket bound to ``::`` also takes IPv4 connections (Linux's default)."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::", 0))
            return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    except OSError:
        return False


@pytest.mark.skipif(not dual_stack(), reason="no dual-stack IPv6 socket here")
async def test_an_ipv4_client_of_a_dual_stack_socket_is_one_client_direct_or_proxied(
    caplog: pytest.LogCaptureFixture,
):
    # Listening on ::, an IPv4 peer is seen as ::ffff:127.0.0.2; the proxy on ::1 names the
    # same client 127.0.0.2. One bucket for both, and the access log names it one way.
    caplog.set_level(logging.INFO, logger="replystream.access")
    guard = GuardConfig(per_minute=PER_MINUTE, trusted_proxies=parse_trusted_proxies(["::1"]))
    async with running(create_app(fast_engine(), ServerConfig(guard=guard)), host="::") as url:
        port = urlsplit(url).port
        via_proxy = f"http://[::1]:{port}/stream?max_tokens=2"
        direct = f"http://127.0.0.1:{port}/stream?max_tokens=2"
        statuses = [await status_from("::1", via_proxy, "127.0.0.2") for _ in range(2)]
        statuses.append(await status_from("127.0.0.2", direct))
        # A request the parser refuses is logged with its client named the same way.
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.2", 0)
        )
        writer.write(b"NOT HTTP\r\n\r\n")
        assert b" 400 " in await reader.readline()
        await reader.read()
        writer.close()
    assert statuses == [200, 200, 429]
    clients = [json.loads(r.getMessage())["client"] for r in caplog.records]
    assert clients == ["127.0.0.2"] * 4, clients


@pytest.mark.skipif(not dual_stack(), reason="no dual-stack IPv6 socket here")
@pytest.mark.parametrize("trusted", ["::ffff:127.0.0.1", "::ffff:127.0.0.0/104"])
async def test_a_proxy_given_as_an_ipv4_mapped_address_is_trusted(trusted: str):
    # The form a dual-stack socket shows an IPv4 peer in: the proxy at 127.0.0.1 it names.
    guard = GuardConfig(per_minute=PER_MINUTE, trusted_proxies=parse_trusted_proxies([trusted]))
    async with running(create_app(fast_engine(), ServerConfig(guard=guard)), host="::") as url:
        stream = f"http://127.0.0.1:{urlsplit(url).port}/stream?max_tokens=2"
        alice = [await status_from("127.0.0.1", stream, "203.0.113.1") for _ in range(3)]
        bob = await status_from("127.0.0.1", stream, "203.0.113.2")
    assert alice == [200, 200, 429]
    assert bob == 200


async def test_a_direct_client_cannot_forge_x_forwarded_for():
    async with serve("10.0.0.0/8") as url:
        stream = f"{url}/stream?max_tokens=2"
        forged = [await status_from("127.0.0.2", stream, f"198.51.100.{n}") for n in range(3)]
        other = await status_from("127.0.0.3", stream, "198.51.100.1")
    assert forged == [200, 200, 429]  # one bucket, whatever the header claims
    assert other == 200  # a different peer is a different client


async def test_two_clients_through_the_shipped_nginx_config_are_limited_apart(tmp_path: Path):
    async with serve("127.0.0.1") as url:
        port = free_port()
        async with running_nginx(deploy_config(url, port), port, tmp_path) as proxy:
            stream = f"{proxy}/stream?max_tokens=2"
            first = [await status_from("127.0.0.2", stream, "192.0.2.7") for _ in range(3)]
            second = await status_from("127.0.0.3", stream)
    # The forged 192.0.2.7 is left of what nginx appended: the limit counts 127.0.0.2.
    assert first == [200, 200, 429]
    assert second == 200


async def test_a_bad_trusted_proxy_is_one_line_naming_the_flag():
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replystream",
        "serve",
        "--port",
        "0",
        "--trusted-proxy",
        "10.0.0.0/8,proxy.internal",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2 and out == b""
    assert err.decode().splitlines() == [
        "replystream serve: --trusted-proxy wants IP addresses or CIDR networks "
        "(e.g. 10.0.0.0/8,127.0.0.1), got 'proxy.internal'"
    ]
