"""An https upstream reached with a routes file's own TLS: its certificate checked against the
CAs its ``ca_file`` holds (not the system's), and this relay's own certificate shown to it
(``cert_file``, ``key_file``: mutual TLS), by relayed requests and health probes alike; and
every mistake in those files one line at start-up naming the entry and the field.

The upstream is a small aiohttp app serving TLS on loopback that asks for a client
certificate its own CA signed; the relay a replystream app on another port. The certificates
are made here: a server CA and a certificate for ``localhost``, and a client CA and a
certificate for the relay."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

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
    runner = web.AppRunner(upstream.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield f"https://localhost:{port}/v1", upstream
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
    # the connection; over TLS 1.2 the handshake itself fails.
    code = json.loads(refused.raw)["error"]["code"]
    assert code in ("upstream_disconnected", "upstream_tls"), code


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
