"""DNS rebinding: a site's page whose name was pointed at 127.0.0.1 reaches a server on this
machine as a page of the same origin, so its requests carry that site's name in ``Host`` (and
in ``Origin``, which then agrees with it). On a connection to a loopback address only local
names are taken, and those ``--allowed-host`` adds; over a network every name is."""

from __future__ import annotations

import json
import socket

import pytest

from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.rawhttp import raw_request

CHAT = json.dumps({"model": "simulated", "messages": [{"role": "user", "content": "hi"}]})
MESSAGES = json.dumps(
    {"model": "simulated", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
)


def serve_with(*allowed: str, host: str = "127.0.0.1"):
    config = ServerConfig(guard=GuardConfig(allowed_hosts=allowed))
    return running(create_app(fast_engine(), config), host=host)


async def answer(url: str, host: str, method: str = "GET", body: str = "", **headers: str):
    response = await raw_request(url, method, body.encode(), {"Host": host, **headers})
    return response.status, await response.read_body()


async def test_a_rebound_site_name_is_refused_on_every_route_in_its_shape():
    async with serve_with() as url:
        port = url.rsplit(":", 1)[1]
        site = f"rebind.attacker.example:{port}"
        origin = f"http://{site}"
        # The page's POST: its Origin agrees with Host, so the origin check alone took it.
        status, body = await answer(f"{url}/v1/chat/completions", site, "POST", CHAT, Origin=origin)
        assert status == 403, body
        error = json.loads(body)["error"]
        assert error["code"] == "host_not_allowed"
        assert "--allowed-host rebind.attacker.example" in error["message"]
        # A same-origin GET carries no Origin at all.
        for path in ("/v1/models", "/wait?max_tokens=2", "/metrics", "/"):
            status, body = await answer(f"{url}{path}", site)
            assert status == 403, (path, body)
        status, body = await answer(
            f"{url}/v1/messages", site, "POST", MESSAGES, **{"anthropic-version": "2023-06-01"}
        )
        assert status == 403
        said = json.loads(body)
        assert (said["type"], said["error"]["type"]) == ("error", "permission_error"), said


async def test_local_names_are_taken():
    async with serve_with() as url:
        port = url.rsplit(":", 1)[1]
        names = (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            "localhost",
            f"[::1]:{port}",
            "app.localhost",
            "printer.local",
            "db.internal",
            "myhost",  # one label: no site's name
            socket.gethostname(),
        )
        for name in names:
            status, body = await answer(f"{url}/v1/chat/completions", name, "POST", CHAT)
            assert status == 200, (name, body)


async def test_allowed_host_takes_a_name_and_a_domains_subdomains():
    async with serve_with("chat.example.com", "*.corp.example") as url:
        for name in ("chat.example.com", "CHAT.example.com:8080", "a.b.corp.example"):
            status, body = await answer(f"{url}/v1/models", name)
            assert status == 200, (name, body)
        for name in ("example.com", "corp.example", "chat.example.com.evil.example"):
            status, _ = await answer(f"{url}/v1/models", name)
            assert status == 403, name
    async with serve_with("*") as url:
        status, _ = await answer(f"{url}/v1/models", "anything.example")
        assert status == 200


def _network_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this picks a source address
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if address.startswith("127.") else address


async def test_a_connection_over_a_network_is_not_asked_for_a_local_name():
    address = _network_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    async with serve_with(host="0.0.0.0") as url:
        port = url.rsplit(":", 1)[1]
        status, body = await answer(f"http://{address}:{port}/v1/models", "api.example.com")
        assert status == 200, body
        # The same server reached at its loopback address: the same name is refused.
        status, _ = await answer(f"http://127.0.0.1:{port}/v1/models", "api.example.com")
        assert status == 403
