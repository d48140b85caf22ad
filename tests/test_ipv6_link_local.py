"""A server on a link-local IPv6 address (``--host fe80::...%eth0``): the URL it announces
names the interface (``http://[fe80::1%25eth0]:PORT``, RFC 6874), since such an address
without it can be connected to on no interface, and the measuring tools reach that URL.

Over this machine's own link-local address; skipped where it has none."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from replystream.client.transport import http_request
from replystream.server import create_app, running
from tests.conftest import fast_engine


def link_local() -> str | None:
    """An IPv6 link-local address of this machine, with its zone (``fe80::1%eth0``)."""
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hex_address, _index, _length, scope, _flags, name = line.split()
        if scope == "20":  # link
            packed = bytes.fromhex(hex_address)
            return f"{socket.inet_ntop(socket.AF_INET6, packed)}%{name}"
    return None


ADDRESS = link_local()


@pytest.mark.skipif(ADDRESS is None, reason="no link-local IPv6 address here")
async def test_a_link_local_server_announces_a_url_with_its_zone_that_the_tools_reach():
    assert ADDRESS is not None
    address, interface = ADDRESS.split("%")
    async with running(create_app(fast_engine()), host=ADDRESS) as url:
        assert url.startswith(f"http://[{address}%25{interface}]:"), url
        async with http_request(f"{url}/healthz") as response:
            assert response.status == 200
