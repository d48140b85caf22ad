"""An https upstream reached with a routes file's own TLS: its certificate checked against the
CAs its ``ca_file`` holds (not the system's), and this relay's own certificate shown to it
(``cert_file``, ``key_file``: mutual TLS), by relayed requests and health probes alike; and
every mistake in those files one line at start-up naming the entry and the field.

The upstream is a small aiohttp app serving TLS on loopback that asks for a client
certificate its own CA signed, or a replystream process behind a real nginx that does (the
usual front of a model server, which refuses a connection's certificate with a 400 page of
its own); the relay a replystream app on another port. The certificates are made here: a
server CA and a certificate for ``localhost``, and a client CA and a certificate for the
relay."""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig
from replystream.engine.upstream_routes import load_routes
from replystream.server import create_app, running
from tests.certificates import Authority
from tests.nginx import running_nginx
from tests.processes import replica
from tests.services import free_port
from tests.sse_client import post_events
from tests.test_bench_tls import make_certificates
from tests.test_upstream_routing import Upstream

ASK = {"messages": [{"role": "user", "content": "hi"}]}


def client_certificate(folder: Path) -> tuple[Path, Path, Path]:
    """A client CA (client-ca.pem) and a certificate for the relay it signs, for client
    authentication (relay.pem, its key relay.key)."""
    authority = Authority("replystream test client CA")
    ca_file = authority.write(folder / "client-ca.pem")
    return (ca_file, *authority.issue(folder, "relay", ExtendedKeyUsageOID.CLIENT_AUTH))


@asynccontextmanager
async def mtls_upstream(folder: Path) -> AsyncIterator[tuple[str, Upstream]]:
    """``Upstream`` over TLS for ``localhost``, asking for a certificate the client CA
    signed; its base URL (the files in ``folder``: ca.pem, relay.pem, relay.key)."""
    _, cert, key = make_certificates(folder)
    client_ca, _, _ = client_certificate(folder)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(cert, key)
    upstream = Upstream(["m"])
    async with served_over_tls(upstream, context) as url:
        yield url, upstream


@asynccontextmanager
async def served_over_tls(upstream: Upstream, context: ssl.SSLContext) -> AsyncIterator[str]:
    """``upstream`` served over TLS (``context``) on a loopback port; its base URL, naming
    ``localhost``."""
    runner = web.AppRunner(upstream.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield f"https://localhost:{port}/v1"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def relay_with(routes: Path) -> AsyncIterator[str]:
    engine = UpstreamEngine(UpstreamConfig(load_routes(routes).targets, health_s=0.2))
    async with running(create_app(engine)) as url:
        yield url


async def test_an_upstream_is_reached_with_its_own_cas_and_the_relays_certificate(
    tmp_path: Path,
):
    async with mtls_upstream(tmp_path) as (url, upstream):
        shown = tmp_path / "shown.toml"
        shown.write_text(
            f'[[upstreams]]\nurl = "{url}"\nca_file = "ca.pem"\n'
            'cert_file = "relay.pem"\nkey_file = "relay.key"\n'
        )
        unshown = tmp_path / "unshown.toml"
        unshown.write_text(f'[[upstreams]]\nurl = "{url}"\nca_file = "ca.pem"\nmodels = ["m"]\n')
        async with relay_with(shown) as relay:
            served = await post_events(f"{relay}/v1/chat/completions", ASK)
        async with relay_with(unshown) as relay:
            refused = await post_events(f"{relay}/v1/chat/completions", ASK)
    assert served.status == 200, served.raw
    assert json.loads(served.raw)["choices"][0]["message"]["content"] == "w0 w1 w2 "
    assert len(upstream.bodies) == 1  # the relay without a certificate got nowhere
    assert refused.status == 502, refused.raw
    # Over TLS 1.3 the upstream refuses a missing certificate after the handshake, closing
    # the connection with no alert (as Python's asyncio servers do, uvicorn's and vLLM's
    # among them); over TLS 1.2 the handshake itself fails.
    error = json.loads(refused.raw)["error"]
    assert error["code"] in ("upstream_disconnected", "upstream_tls"), error
    if error["code"] == "upstream_disconnected":
        assert error["message"].endswith(
            "closed the connection before answering; does it ask for a client certificate? "
            "This relay shows none (cert_file and key_file in the routes file)"
        ), error


async def test_the_models_are_probed_with_the_same_tls(tmp_path: Path):
    async with mtls_upstream(tmp_path) as (url, _):
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f'[[upstreams]]\nurl = "{url}"\nca_file = "ca.pem"\ncert_file = "relay.pem"\n'
            'key_file = "relay.key"\n'
        )
        engine = UpstreamEngine(UpstreamConfig(load_routes(routes).targets))
        async with running(create_app(engine)):
            readiness = await engine.readiness()
    assert readiness.ready
    assert engine.model_names() == ("m",)  # its own list, asked over mutual TLS


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ('ca_file = "missing.pem"', "upstreams[0].ca_file: {folder}/missing.pem: cannot be read"),
        (
            'ca_file = "junk.pem"',
            "upstreams[0].ca_file: {folder}/junk.pem: holds no CA certificate",
        ),
        ('key_file = "relay.key"', "upstreams[0].key_file: is the key of cert_file"),
        (
            'cert_file = "relay.pem"\nkey_file = "other.key"',
            "upstreams[0].cert_file: {folder}/relay.pem: is not a certificate and a key",
        ),
    ],
)
def test_a_tls_mistake_in_the_routes_file_is_one_line_naming_the_field(
    tmp_path: Path, fields: str, says: str
):
    client_certificate(tmp_path)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    other = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "other.key").write_bytes(
        other.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    routes = tmp_path / "routes.toml"
    routes.write_text(f'[[upstreams]]\nurl = "https://gpu:8443/v1"\n{fields}\n')
    with pytest.raises(ValueError) as caught:
        load_routes(routes)
    message = str(caught.value)
    assert message.startswith(f"{routes}: ") and "\n" not in message
    assert says.format(folder=tmp_path) in message, message


def test_tls_files_are_for_an_https_upstream(tmp_path: Path):
    client_certificate(tmp_path)
    routes = tmp_path / "routes.toml"
    routes.write_text('[[upstreams]]\nurl = "http://gpu:8000/v1"\nca_file = "client-ca.pem"\n')
    with pytest.raises(ValueError, match=r"upstreams\[0\]\.ca_file: is for an https:// upstream"):
        load_routes(routes)


@asynccontextmanager
async def nginx_mtls_front(
    folder: Path, *, replies_only: bool = False
) -> AsyncIterator[tuple[int, str]]:
    """A simulated replystream behind nginx serving TLS for ``localhost`` on a port of its
    own and asking for a client certificate the client CA signed (``ssl_verify_client on``;
    ``replies_only``: for chat completions alone, its model list open to anyone): nginx's
    port, and the replystream's own URL (plain HTTP, no front)."""
    _, cert, key = make_certificates(folder)
    client_ca, _, _ = client_certificate(folder)
    schedule = ("--engine", "simulated", "--delay-ms", "0", "--jitter-ms", "0", "--tokens", "3")
    async with replica(*schedule) as (_, app_url):
        port = free_port()
        upstream = app_url.removeprefix("http://")
        verify = "optional" if replies_only else "on"
        guarded = (
            "location /v1/chat/completions { if ($ssl_client_verify != SUCCESS) { return 496; }"
            f" proxy_pass http://{upstream}; }}"
            if replies_only
            else ""
        )
        config = f"""    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_client_certificate {client_ca};
        ssl_verify_client {verify};
        {guarded}
        location / {{ proxy_pass http://{upstream}; }}
    }}"""
        async with running_nginx(config, port, folder / "nginx"):
            yield port, app_url


async def test_a_tls_front_refusing_the_relays_connection_is_the_relays_fault_not_the_clients(
    tmp_path: Path,
):
    """nginx answers a connection without the certificate it asks for, with one it does not
    trust, or in plain HTTP to its TLS port, with a 400 page: once relayed as the client's
    own mistake (400 ``upstream_rejected``, never failed over), now a 502 ``upstream_tls``
    saying what to fix, and the probe says the same."""
    Authority("another client CA").issue(
        tmp_path / "other", "stranger", ExtendedKeyUsageOID.CLIENT_AUTH
    )
    async with nginx_mtls_front(tmp_path) as (port, _):
        https = f'url = "https://localhost:{port}/v1"\nca_file = "ca.pem"\nmodels = ["simulated"]\n'
        cases = {
            "shown": (https + 'cert_file = "relay.pem"\nkey_file = "relay.key"\n', None),
            "none": (https, "asks for a client certificate, and this relay shows none"),
            "untrusted": (
                https + 'cert_file = "other/stranger.pem"\nkey_file = "other/stranger.key"\n',
                "refused the client certificate this relay shows",
            ),
            "plain": (
                f'url = "http://localhost:{port}/v1"\nmodels = ["simulated"]\n',
                "it is a TLS port, spoken to in plain HTTP: its URL must begin with https://",
            ),
        }
        for name, (fields, says) in cases.items():
            routes = tmp_path / f"{name}.toml"
            routes.write_text(f"[[upstreams]]\n{fields}")
            engine = UpstreamEngine(UpstreamConfig(load_routes(routes).targets, health_s=0.2))
            async with running(create_app(engine)) as relay:
                answer = await post_events(f"{relay}/v1/chat/completions", ASK)
                readiness = await engine.readiness()
            if says is None:
                assert answer.status == 200, answer.raw
                assert readiness.ready, readiness
                continue
            assert answer.status == 502, (name, answer.raw)
            error = json.loads(answer.raw)["error"]
            assert error["code"] == "upstream_tls" and says in error["message"], (name, error)
            assert not readiness.ready and says in readiness.reason, (name, readiness)


async def test_a_request_refused_by_a_tls_front_goes_to_another_upstream(tmp_path: Path):
    # The front asks for a certificate for replies only: its probe passes, and the relay
    # learns of the refusal from requests, each moved to the other upstream.
    async with nginx_mtls_front(tmp_path, replies_only=True) as (port, app_url):
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f'[[upstreams]]\nurl = "https://localhost:{port}/v1"\nca_file = "ca.pem"\n'
            f'models = ["simulated"]\n\n[[upstreams]]\nurl = "{app_url}/v1"\n'
            'models = ["simulated"]\n'
        )
        # Its circuit never opens here, so requests keep going to it first now and then.
        engine = UpstreamEngine(UpstreamConfig(load_routes(routes).targets, failures=100))
        async with running(create_app(engine)) as relay:
            answers = [await post_events(f"{relay}/v1/chat/completions", ASK) for _ in range(6)]
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{relay}/metrics") as response:
                    metrics = await response.text()
    assert [a.status for a in answers] == [200] * 6, [a.raw for a in answers]
    front = f"https://localhost:{port}/v1"
    refused = re.search(
        rf'replystream_upstream_attempts{{result="connect_error",upstream="{front}"}} (\S+)',
        metrics,
    )
    assert refused is not None and float(refused.group(1)) >= 1, metrics


@pytest.mark.parametrize("key_in", ["key_file", "cert_file"])
def test_an_encrypted_key_is_one_line_naming_its_field_not_a_passphrase_prompt(
    tmp_path: Path, key_in: str
):
    """A routes file gives no passphrase: OpenSSL once asked for one on the terminal (a
    check, a start or a reload of the routes waiting there), and without one the start said
    only ``[Errno 22] Invalid argument``, after two prompts."""
    _, cert, key = client_certificate(tmp_path)
    loaded = serialization.load_pem_private_key(key.read_bytes(), None)
    encrypted = loaded.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase"),
    )
    if key_in == "key_file":
        (tmp_path / "relay.key").write_bytes(encrypted)
        fields = 'cert_file = "relay.pem"\nkey_file = "relay.key"'
    else:
        (tmp_path / "both.pem").write_bytes(cert.read_bytes() + encrypted)
        fields = 'cert_file = "both.pem"'
    routes = tmp_path / "routes.toml"
    routes.write_text(f'[[upstreams]]\nurl = "https://gpu:8443/v1"\nmodels = ["m"]\n{fields}\n')
    check = ["serve", "--check", "--engine", "upstream", "--upstream-routes", str(routes)]
    done = subprocess.run(
        [sys.executable, "-m", "replystream", *check],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    file = "relay.key" if key_in == "key_file" else "both.pem"
    assert done.stderr == (
        f"replystream serve: --upstream-routes {routes}: upstreams[0].{key_in}: "
        f"{tmp_path / file}: the key is encrypted, and a routes file gives no passphrase: "
        "decrypt it (openssl pkey -in KEY -out KEY.plain)\n"
    )
