"""``replystream bench`` against an https deployment: a real nginx terminating TLS on loopback
in front of a ``replystream serve`` process that wants an API key.

The certificates are made here: a CA, and a server certificate it signs for the name
``localhost`` only (not for 127.0.0.1), so the tests can tell a verified connection from one
refused for its CA and from one refused for its name.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from replystream.client import measure_reply
from replystream.client.transport import tls_context
from tests.certificates import Authority
from tests.nginx import running_nginx
from tests.processes import replica
from tests.services import free_port

KEY = "sk-tls-test"


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA (ca.pem) and a server certificate for ``localhost`` it signs (server.pem, its key
    server.key)."""
    authority = Authority("replystream test CA")
    ca_file = authority.write(folder / "ca.pem")
    return (
        ca_file,
        *authority.issue(folder, "server", ExtendedKeyUsageOID.SERVER_AUTH, "localhost"),
    )


def tls_proxy_config(port: int, upstream: str, cert: Path, key: Path) -> str:
    """nginx terminating TLS on ``port`` and proxying to ``upstream`` unbuffered; it names the
    SNI it was sent in ``X-SNI``."""
    return f"""    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{
            proxy_pass http://{upstream};
            proxy_buffering off;
            add_header X-SNI "$ssl_server_name" always;
        }}
    }}"""


@dataclass
class Deployment:
    https_port: int
    ca_file: Path


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    ca_file, cert, key = make_certificates(tmp_path / "certs")
    # 20 tokens 10 ms apart: a reply of 200 ms, longer than the pauses a busy machine gives
    # the server (3 ms apart, all 20 once reached doctor together with the head at 88 ms,
    # and it rightly judged that stream buffered).
    schedule = ("--engine", "simulated", "--delay-ms", "10", "--jitter-ms", "0", "--tokens", "20")
    async with replica(*schedule, "--api-key", KEY) as (_, app_url):
        port = free_port()
        upstream = app_url.removeprefix("http://")
        config = tls_proxy_config(port, upstream, cert, key)
        async with running_nginx(config, port, tmp_path / "nginx"):
            yield Deployment(port, ca_file)


async def tool(*argv: str) -> tuple[int, str, str]:
    """``replystream ARGV`` in a child process: its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replystream",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def bench(*argv: str) -> tuple[int, str]:
    code, out, err = await tool("bench", *argv, "--quiet")
    return code, out + err


async def read_json(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(await asyncio.to_thread(path.read_text))
    return result


async def test_bench_over_https_verifies_sends_its_headers_and_resumes(deployment, tmp_path):
    out = tmp_path / "tls.json"
    url = f"https://localhost:{deployment.https_port}/v1/replies"
    code, text = await bench(
        url,
        "--cacert",
        str(deployment.ca_file),
        "--header",
        f"Authorization: Bearer {KEY}",
        "--concurrency",
        "3",
        "--requests",
        "8",
        "--output-tokens",
        "20",
        "--drop-share",
        "0.5",
        "--drop-after",
        "4",
        "--server-metrics",
        "--json",
        str(out),
    )
    assert code == 0, text
    result = await read_json(out)
    # The server wants the key on every request, resume and scrape: all of them reached it
    # through TLS with the header on.
    assert result["counts"]["complete"] == 8
    assert all(r["tokens"] == 20 for r in result["requests"])
    assert result["resume"]["drops"] >= 1
    assert result["resume"]["resumed"] == result["resume"]["drops"]
    assert (result["resume"]["lost"], result["resume"]["duplicated"]) == (0, 0)
    assert "error" not in result["server"]
    assert result["server"]["replies"]["finished"] >= 8

    # Without the key, the same TLS connection reaches the app and is refused by it.
    code, text = await bench(url, "--cacert", str(deployment.ca_file), "--requests", "2")
    assert code == 1 and "HTTP 401" in text


async def test_the_client_sends_the_host_as_sni_over_tls(deployment):
    url = f"https://localhost:{deployment.https_port}/v1/replies"
    timing = await measure_reply(
        url,
        method="POST",
        json_body={"prompt": "x", "max_tokens": 5},
        headers={"Authorization": f"Bearer {KEY}"},
        tls=tls_context(deployment.ca_file),
    )
    assert timing.complete, timing.error
    assert timing.headers["x-sni"] == "localhost"
    assert timing.tokens == 5


@pytest.mark.parametrize(
    ("host", "flags", "refusal"),
    [
        # The system's CAs do not know the test CA.
        ("localhost", (), "certificate verify failed"),
        # The right CA, but the certificate names localhost, not this address.
        ("127.0.0.1", ("--cacert", "CA"), "IP address mismatch"),
    ],
)
async def test_a_server_that_fails_verification_is_refused(deployment, host, flags, refusal):
    flags = tuple(str(deployment.ca_file) if f == "CA" else f for f in flags)
    url = f"https://{host}:{deployment.https_port}/v1/replies"
    code, text = await bench(url, *flags, "--header", f"Authorization: Bearer {KEY}")
    assert code == 1
    # No request reached the app: the run stops at the first and says why in one line.
    line = text.strip()
    assert line.startswith(f"replystream bench: cannot connect to {host}:"), text
    assert refusal in line and "nothing was measured" in line and "\n" not in line


async def test_insecure_skips_verification_on_purpose(deployment):
    url = f"https://127.0.0.1:{deployment.https_port}/v1/replies"
    code, text = await bench(
        url, "--insecure", "--requests", "3", "--header", f"Authorization: Bearer {KEY}"
    )
    assert code == 0, text
    assert "3 complete" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--insecure", "--cacert", "CA"], "--insecure verifies nothing"),
        (["--cacert", "NOT_PEM"], "--cacert: "),
    ],
)
async def test_tls_flag_mistakes_are_one_line(tmp_path, argv, message):
    ca_file, _, _ = make_certificates(tmp_path / "certs")
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    names = {"CA": str(ca_file), "NOT_PEM": str(not_pem)}
    url = f"https://localhost:{free_port()}/v1/replies"
    code, text = await bench(url, *(names.get(a, a) for a in argv))
    assert code == 2
    assert text.startswith("replystream bench: ") and message in text
    assert text.count("\n") == 1


async def doctor(*argv: str) -> tuple[int, str, str]:
    return await tool("doctor", *argv)


async def test_doctor_judges_an_https_endpoint_that_wants_a_key(deployment):
    """The public URL of a deployment is an https one behind a key: doctor verifies it
    against the CA given, sends the header on the request and the models lookup, and judges
    the stream through nginx (unbuffered: streaming)."""
    url = f"https://localhost:{deployment.https_port}/v1/chat/completions"
    ca = ("--cacert", str(deployment.ca_file))
    key = ("--header", f"Authorization: Bearer {KEY}")
    code, out, err = await doctor(url, *ca, *key, "--json")
    assert code == 0, out + err
    assert json.loads(out)["verdict"] == "streaming"
    # Without the key: the server's 401, said, and a failed verdict.
    code, out, err = await doctor(url, *ca, "--model", "simulated", "--json")
    assert code == 1 and json.loads(out)["status"] == 401
    # Not trusting its CA: refused, said, never read.
    code, out, err = await doctor(url, *key, "--model", "simulated")
    assert code == 1 and "CERTIFICATE_VERIFY_FAILED" in out, out + err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["http://127.0.0.1:1/stream", "--insecure"], "--insecure skips verifying an https"),
        (["https://h:1/stream", "--insecure", "--cacert", "CA"], "drop one"),
        (["https://h:1/stream", "--cacert", "CA"], "holds no usable PEM"),
    ],
)
async def test_doctors_tls_mistakes_are_one_line(argv: list[str], says: str, tmp_path: Path):
    not_a_ca = tmp_path / "ca.pem"
    not_a_ca.write_text("not a certificate\n")
    code, out, err = await doctor(*[str(not_a_ca) if a == "CA" else a for a in argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and says in err, err
