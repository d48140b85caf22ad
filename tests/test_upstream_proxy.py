"""Upstreams reached through a proxy named by the environment, as curl, requests and httpx
take it: ``HTTPS_PROXY`` for an https upstream (a tunnel opened by ``CONNECT``, TLS inside
it end to end), ``HTTP_PROXY`` for an http one (requests in absolute form), ``NO_PROXY`` for
the hosts reached directly; a user name and password in the proxy's URL, never in a message.
Relayed requests and health probes alike.

The proxy is a real tinyproxy (Debian's package) started here on a free loopback port; the
upstreams small aiohttp apps (one over TLS for ``localhost``, its CA made here); the relay a
replystream app in this process, made after the environment is set."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.engine.upstream_routes import load_routes
from replystream.server import create_app, running
from tests.nginx import running_nginx_stream
from tests.processes import replica
from tests.services import free_port, require_binary
from tests.sse_client import post_events
from tests.test_bench_tls import make_certificates
from tests.test_cli_mistakes import run
from tests.test_upstream_routing import Upstream
from tests.test_upstream_tls import served_over_tls

ASK = {"messages": [{"role": "user", "content": "hi"}]}
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "ALL_PROXY")


@pytest.fixture(autouse=True)
def no_proxy_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the proxies each test names."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


class Tinyproxy:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def lines(self, word: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if word in line]


@asynccontextmanager
async def tinyproxy(folder: Path, credentials: str | None = None) -> AsyncIterator[Tinyproxy]:
    """tinyproxy on a free loopback port, asking for ``credentials`` (user:password) if
    given; it logs each request and tunnel it serves."""
    binary = require_binary("tinyproxy")
    log = folder / "tinyproxy.log"
    for _ in range(3):  # a port free a moment ago may be taken by the time it binds
        port = free_port()
        lines = [
            f"Port {port}",
            "Listen 127.0.0.1",
            "Timeout 60",
            "MaxClients 50",
            f'LogFile "{log}"',
            "LogLevel Info",
            "Allow 127.0.0.1",
        ]
        if credentials:
            lines.append("BasicAuth " + credentials.replace(":", " "))
        config = folder / "tinyproxy.conf"
        config.write_text("\n".join(lines) + "\n")
        log.write_text("")
        process = await asyncio.create_subprocess_exec(binary, "-d", "-c", str(config))
        if await listening(process, log):
            break
        await process.wait()
    else:
        raise AssertionError(f"tinyproxy did not start: {log.read_text()}")
    try:
        yield Tinyproxy(f"127.0.0.1:{port}", log)
    finally:
        process.terminate()
        await process.wait()


async def listening(process: asyncio.subprocess.Process, log: Path) -> bool:
    """Whether tinyproxy bound its port and accepts connections (its log says so once it
    has), rather than exiting."""
    for _ in range(400):
        if "Accepting connections" in await asyncio.to_thread(log.read_text):
            return True
        if process.returncode is not None:
            return False
        await asyncio.sleep(0.025)
    process.kill()
    return False


@asynccontextmanager
async def tls_upstream(folder: Path) -> AsyncIterator[tuple[Path, Upstream]]:
    """``Upstream`` over TLS for ``localhost``; a routes file reaching it with its CA."""
    _, cert, key = make_certificates(folder)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    upstream = Upstream(["m"])
    async with served_over_tls(upstream, context) as url:
        routes = folder / "routes.toml"
        routes.write_text(f'[[upstreams]]\nurl = "{url}"\nca_file = "ca.pem"\n')
        yield routes, upstream


@asynccontextmanager
async def relay(
    targets: tuple[UpstreamTarget, ...], headers_timeout_s: float = 30.0, health_s: float = 0.2
) -> AsyncIterator[str]:
    config = UpstreamConfig(targets, health_s=health_s, headers_timeout_s=headers_timeout_s)
    engine = UpstreamEngine(config)
    async with running(create_app(engine)) as url:
        yield url


async def healthz(url: str, expect: int = 200) -> tuple[int, str]:
    """The probes' verdict once it is ``expect`` (a probe of 0.2 s through a proxy and TLS
    can time out on a loaded machine; the next one decides), else the last one in 5 s."""
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            async with session.get(f"{url}/healthz") as response:
                body = await response.text()
            if "not checked yet" not in body and response.status == expect:
                break
            await asyncio.sleep(0.1)
    return response.status, body


async def test_an_https_upstream_is_reached_through_a_tunnel_and_no_proxy_skips_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    async with tinyproxy(tmp_path) as proxy, tls_upstream(tmp_path) as (routes, upstream):
        monkeypatch.setenv("HTTPS_PROXY", f"http://{proxy.url}")
        async with relay(load_routes(routes).targets) as url:
            served = await post_events(f"{url}/v1/chat/completions", ASK)
            health = await healthz(url)
        tunnels = proxy.lines("CONNECT localhost:")
        monkeypatch.setenv("NO_PROXY", "localhost")
        async with relay(load_routes(routes).targets) as url:
            direct = await post_events(f"{url}/v1/chat/completions", ASK)
    assert served.status == 200, served.raw
    assert json.loads(served.raw)["choices"][0]["message"]["content"] == "w0 w1 w2 "
    assert health[0] == 200, health
    assert len(tunnels) >= 2, tunnels  # the relayed request's and the probe's
    assert direct.status == 200, direct.raw
    assert proxy.lines("CONNECT localhost:") == tunnels  # NO_PROXY: none more
    assert len(upstream.bodies) == 2


async def test_an_http_upstream_is_sent_requests_through_the_proxy_with_its_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    upstream = Upstream(["m"])
    async with tinyproxy(tmp_path, "relay:s3cret") as proxy, running(upstream.app()) as base:
        targets = (UpstreamTarget(f"{base}/v1"),)
        monkeypatch.setenv("HTTP_PROXY", f"http://relay:s3cret@{proxy.url}")
        async with relay(targets) as url:
            served = await post_events(f"{url}/v1/chat/completions", ASK)
            health = await healthz(url)
        monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.url}")  # no user name or password
        async with relay(targets) as url:
            refused = await post_events(f"{url}/v1/chat/completions", ASK)
            unhealthy = await healthz(url, expect=503)
    assert served.status == 200, served.raw
    assert health[0] == 200, health
    # Every request the upstream got came through the proxy (it says so in Via).
    assert upstream.headers and all("tinyproxy" in h.get("Via", "") for h in upstream.headers)
    assert refused.status == 502, refused.raw
    message = json.loads(refused.raw)["error"]["message"]
    assert message.endswith(
        "answered 407: it asks for a user name and password (they go in the proxy's URL: "
        "http://user:password@host:port)"
    ), message
    assert unhealthy[0] == 503 and "answered 407" in unhealthy[1], unhealthy


@pytest.mark.parametrize(
    ("host", "no_proxy"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.0/8"),
        ("127.0.0.1", "10.0.0.0/8, 127.0.0.0/24"),
        # curl, requests and httpx take ``::1`` (the usual "localhost,127.0.0.1,::1") for an
        # upstream at http://[::1]:PORT; the standard library's matching alone does not.
        ("::1", "localhost,127.0.0.1,::1"),
        ("::1", "[::1]"),
        ("::1", "0:0::1"),
    ],
)
async def test_no_proxy_names_the_hosts_and_networks_reached_directly(
    host: str, no_proxy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    upstream = Upstream(["m"])
    async with tinyproxy(tmp_path) as proxy, running(upstream.app(), host=host) as base:
        monkeypatch.setenv("HTTP_PROXY", f"http://{proxy.url}")
        monkeypatch.setenv("NO_PROXY", no_proxy)
        async with relay((UpstreamTarget(f"{base}/v1"),)) as url:
            served = await post_events(f"{url}/v1/chat/completions", ASK)
    assert served.status == 200, served.raw
    assert upstream.headers and not any("Via" in h for h in upstream.headers)
    asked = f":{base.rsplit(':', 1)[1]}/"  # in the URL of any request the proxy served
    assert not proxy.lines(asked), proxy.lines(asked)


async def test_a_proxy_that_refuses_or_cannot_be_reached_is_named_without_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    async with tinyproxy(tmp_path, "relay:s3cret") as proxy, tls_upstream(tmp_path) as (routes, _):
        monkeypatch.setenv("HTTPS_PROXY", f"http://{proxy.url}")  # no user name or password
        async with relay(load_routes(routes).targets) as url:
            refused = await post_events(f"{url}/v1/chat/completions", ASK)
            refused_health = await healthz(url, expect=503)
        closed = free_port()
        monkeypatch.setenv("HTTPS_PROXY", f"http://relay:nope@127.0.0.1:{closed}")
        async with relay(load_routes(routes).targets) as url:
            unreachable = await post_events(f"{url}/v1/chat/completions", ASK)
            unreachable_health = await healthz(url, expect=503)
    shown = f"through the proxy at http://{proxy.url} (HTTPS_PROXY): it refused the tunnel: 407"
    said = json.loads(refused.raw)["error"]
    assert refused.status == 502 and said["code"] == "upstream_unavailable", said
    assert shown in said["message"] and "user name and password" in said["message"], said
    assert shown in refused_health[1], refused_health
    said = json.loads(unreachable.raw)["error"]
    assert unreachable.status == 502, said
    assert said["message"].endswith(
        f"through the proxy at http://127.0.0.1:{closed} (HTTPS_PROXY): it cannot be reached "
        "(connection refused)"
    ), said
    assert f"http://127.0.0.1:{closed} (HTTPS_PROXY): it cannot be reached" in unreachable_health[1]
    everything = (
        (refused.raw + unreachable.raw).decode() + refused_health[1] + unreachable_health[1]
    )
    assert "nope" not in everything


def test_a_proxy_of_another_kind_is_refused_at_start_in_one_line(tmp_path: Path):
    done = run(
        "serve",
        "--engine",
        "upstream:https://api.example.com/v1",
        "--check",
        env={"HTTPS_PROXY": "socks5://user:pw@proxy.example.com:1080"},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "pw" not in done.stderr, done.stderr
    assert "HTTPS_PROXY: a proxy reached over socks5 is not supported" in done.stderr


@asynccontextmanager
async def tls_proxy(folder: Path, credentials: str | None = None) -> AsyncIterator[str]:
    """tinyproxy behind nginx speaking TLS for ``localhost`` (its CA ``folder/ca.pem``, as
    ``make_certificates`` made it): a proxy spoken to in TLS; its URL, credentials in it."""
    _, cert, key = make_certificates(folder)
    port = free_port()
    async with tinyproxy(folder, credentials) as proxy:
        stream = (
            f"    server {{ listen 127.0.0.1:{port} ssl; ssl_certificate {cert}; "
            f"ssl_certificate_key {key}; proxy_pass {proxy.url}; }}"
        )
        async with running_nginx_stream(stream, port, folder / "nginx"):
            userinfo = f"{credentials}@" if credentials else ""
            yield f"https://{userinfo}localhost:{port}"


async def relayed_chat(url: str) -> tuple[int, str, tuple[int, str]]:
    served = await post_events(f"{url}/v1/chat/completions", ASK)
    return served.status, served.raw.decode(), await healthz(url)


async def test_a_proxy_spoken_to_in_tls_carries_a_tunnel_inside_tls_and_plain_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Relay processes of their own, started with the proxy's and the upstream's CAs in
    # SSL_CERT_FILE (OpenSSL reads it for every default context, aiohttp's made at import).
    ca, cert, key = make_certificates(tmp_path / "upstream")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    over_tls, plain = Upstream(["m"]), Upstream(["m"])
    async with (
        tls_proxy(tmp_path, "relay:s3cret") as proxy_url,
        served_over_tls(over_tls, context) as tls_base,
        running(plain.app()) as plain_base,
    ):
        bundle = tmp_path / "bundle.pem"
        bundle.write_bytes((tmp_path / "ca.pem").read_bytes() + ca.read_bytes())
        monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
        monkeypatch.setenv("HTTPS_PROXY", proxy_url)
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        probed = ("--upstream-health-s", "0.2")
        async with replica("--engine", f"upstream:{tls_base}", *probed) as (_, url):
            tunnelled = await relayed_chat(url)
        async with replica("--engine", f"upstream:{plain_base}/v1", *probed) as (_, url):
            absolute = await relayed_chat(url)
    for status, raw, health in (tunnelled, absolute):
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["message"]["content"] == "w0 w1 w2 "
        assert health[0] == 200, health
    assert len(over_tls.bodies) == 1  # reached in TLS, through the tunnel
    assert plain.headers and all("tinyproxy" in h.get("Via", "") for h in plain.headers)


async def test_a_proxy_in_tls_carries_an_upstream_with_its_own_cas_and_its_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The proxy is checked against the system's CAs (SSL_CERT_FILE, the proxy's CA alone
    here), the upstream inside its tunnel against its own ``ca_file`` alone: for relayed
    requests and health probes alike, which go over the same client."""
    (tmp_path / "upstream").mkdir()
    async with (
        tls_proxy(tmp_path, "relay:s3cret") as proxy_url,
        tls_upstream(tmp_path / "upstream") as (routes, upstream),
    ):
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
        monkeypatch.setenv("HTTPS_PROXY", proxy_url)
        probed = ("--upstream-health-s", "0.2")
        args = ("--engine", "upstream", "--upstream-routes", str(routes), *probed)
        async with replica(*args) as (_, url):
            status, raw, health = await relayed_chat(url)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["content"] == "w0 w1 w2 "
    assert health[0] == 200, health
    assert len(upstream.bodies) == 1


async def test_a_proxy_whose_tls_fails_is_named_with_what_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the system's CAs: not the test's
    async with (
        tls_proxy(tmp_path, "relay:s3cret") as proxy_url,
        running(Upstream(["m"]).app()) as plain_http,  # answers a TLS hello in plain HTTP
    ):
        # Never reached: the proxy fails first.
        with_tls = ("--engine", "upstream:https://localhost:9/v1", "--upstream-health-s", "0.2")
        monkeypatch.setenv("HTTPS_PROXY", proxy_url)
        async with replica(*with_tls) as (_, url):
            untrusted = await post_events(f"{url}/v1/chat/completions", ASK)
            health = await healthz(url, expect=503)
        monkeypatch.setenv("HTTPS_PROXY", plain_http.replace("http://", "https://"))
        async with replica(*with_tls) as (_, url):
            not_tls = await post_events(f"{url}/v1/chat/completions", ASK)
    shown = proxy_url.replace("relay:s3cret@", "")
    assert untrusted.status == 502, untrusted.raw
    message = json.loads(untrusted.raw)["error"]["message"]
    assert f"through the proxy at {shown} (HTTPS_PROXY): its TLS certificate is not trusted (" in (
        message
    ), message
    assert "SSL_CERT_FILE" in message and "s3cret" not in message, message
    assert health[0] == 503, health
    assert (
        f"through the proxy at {shown} (HTTPS_PROXY): its TLS certificate is not trusted"
        in (health[1])
    ), health
    assert not_tls.status == 502, not_tls.raw
    message = json.loads(not_tls.raw)["error"]["message"]
    assert message.endswith(
        ": it did not answer in TLS (wrong version number): is it a plain HTTP port? Then its URL "
        "begins with http://"
    ), message


async def test_a_proxy_that_never_finishes_its_tls_handshake_is_named_not_the_upstream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """tinyproxy speaks plain HTTP: given an https:// URL, it waits for a request line that
    never comes, while the relay waits for its side of the handshake. That wait is bounded
    by half the time the request (4 s to its head, here) or the probe (2 s) has, at most
    10 s, so the proxy is named before the deadline would blame the upstream."""
    target = (UpstreamTarget("https://localhost:9/v1"),)
    async with tinyproxy(tmp_path) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", f"https://{proxy.url}")
        async with relay(target, headers_timeout_s=4.0, health_s=2.0) as url:
            started = asyncio.get_running_loop().time()
            got = await post_events(f"{url}/v1/chat/completions", ASK)
            waited = asyncio.get_running_loop().time() - started
            health = await healthz(url, expect=503)
    assert got.status == 502, got.raw
    message = json.loads(got.raw)["error"]["message"]
    said = (
        f"cannot connect to the upstream at https://localhost:9/v1 through the proxy at "
        f"https://{proxy.url} (HTTPS_PROXY): it did not finish a TLS handshake within {{}} s: "
        "is it a plain HTTP port? Then its URL begins with http://"
    )
    assert message == said.format("2"), message
    assert waited < 4, waited  # not the attempt's head timeout
    assert health[0] == 503 and said.split(" within")[0] in health[1], health
