"""What each ``--redis-url`` form names, and what errors may show of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from replystream.delivery.redis_connect import RedisTarget, parse_redis_url
from tests.certificates import Authority


def test_a_sentinel_url_names_its_sentinels_service_and_database():
    target = parse_redis_url("redis+sentinel://u:p%40ss@10.0.0.1,10.0.0.2:26380,[::1]:5/primary/3")
    assert target == RedisTarget(
        target.url,
        "sentinel",
        False,
        (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 5)),
        "primary",
        3,
        "u",
        "p@ss",
    )
    assert target.shown == "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380,[::1]:5/primary/3"


def test_a_cluster_url_names_nodes_to_start_from_and_tls():
    target = parse_redis_url("rediss+cluster://:secret@a:7000,b")
    assert (target.kind, target.tls, target.nodes) == ("cluster", True, (("a", 7000), ("b", 6379)))
    assert target.password == "secret" and "secret" not in target.shown


def test_plain_urls_are_redis_pys_and_shown_without_credentials():
    target = parse_redis_url("rediss://user:pw@cache.example:6380/2")
    assert (target.kind, target.tls) == ("single", True)
    assert target.shown == "rediss://cache.example:6380/2"
    assert parse_redis_url("unix:///run/redis.sock").shown == "unix:///run/redis.sock"


@pytest.mark.parametrize(
    "url",
    [
        "redis://h/3?client_name=replica-a&health_check_interval=5&socket_keepalive=yes",
        "redis://h?db=2",
        "rediss://h/0?ssl_cert_reqs=optional&ssl_check_hostname=false",
        "unix:///run/redis.sock?db=1",
    ],
)
def test_a_url_may_set_what_the_store_leaves_to_its_operator(url: str):
    assert parse_redis_url(url).kind == "single"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://x", "expected one of redis://"),
        ("redis+sentinel://h:1", "names its service"),
        ("redis+sentinel://h:1/svc/x", "must be a number"),
        ("redis+cluster://h:1/0", "only database 0"),
        ("redis+cluster://:pw@", "no host"),
        # redis-py would pass an unknown name to every connection (which then fails), drop a
        # database that is not a number, and let a query override the store's own timeouts.
        ("redis://:pw@h:1/0?foo=bar", "query option 'foo' is not one this server takes"),
        ("redis://h:1/0?socket_timeout=1", "timeouts and retries are its own"),
        ("redis://h:1/0?ssl_certfile=x", "'ssl_certfile' is not one"),  # no TLS: no TLS files
        ("redis://:pw@h/abc", "the database must be a number, got 'abc'"),
        ("redis://h/?db=x", "the database must be a number"),
        # A digit int() does not read: redis-py would drop it and use database 0.
        ("redis://h/\u00b2", "the database must be a number, got '\u00b2'"),
        ("redis+sentinel://h/svc/\u00b2", "the database must be a number"),
        ("redis://h/0?health_check_interval=soon", "Invalid value for 'health_check_interval'"),
        # Taken by redis-py without a word, each failed only on a connection: a negative
        # interval made every connection's first command read another's answer (serve refused
        # at start naming CLIENT SETINFO); a read size of 0 took every read for Redis closing
        # the connection (told as Redis that cannot be reached); Redis refuses such a name.
        ("redis://h/0?health_check_interval=-5", "health_check_interval must be 0 or more"),
        ("redis://h/0?socket_read_size=0", "socket_read_size must be 1 or more bytes, got 0"),
        ("redis://h/0?client_name=replica%20a", "client_name 'replica a': Redis takes a name"),
        ("redis://h/0?client_name=r%0Aa", "client_name 'r.+a': Redis takes a name"),
        ("redis+sentinel://:pw@h/svc?x=1", "takes no query"),
        ("redis+cluster://:pw@h?x=1", "takes no query"),
        # No socket to connect to: redis-py would fail on every command ("Error 22").
        ("unix://", "names its socket"),
        ("unix:///?db=1", "names its socket"),
    ],
)
def test_a_url_that_names_no_redis_is_refused_in_one_line(url: str, says: str):
    with pytest.raises(ValueError, match=says) as caught:
        parse_redis_url(url)
    assert "\n" not in str(caught.value) and "pw" not in str(caught.value)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("redis-tls")
    authority = Authority("redis test ca")
    cert, key = authority.issue(folder, "client", ExtendedKeyUsageOID.CLIENT_AUTH)
    return {"ca": authority.write(folder / "ca.pem"), "cert": cert, "key": key}


@pytest.mark.parametrize(
    ("query", "says"),
    [
        # redis-py reads these only as it connects: every command would fail, a missing file
        # told as "Error 2 connecting to h:6380", as if Redis could not be reached.
        ("ssl_cert_reqs=bogus", "Invalid SSL Certificate Requirements Flag: bogus"),
        ("ssl_ca_certs={missing}", "ssl_ca_certs: no file"),
        ("ssl_certfile={cert}&ssl_keyfile={missing}", "ssl_keyfile: no file"),
        ("ssl_ca_path={missing}", "ssl_ca_path: no folder"),
        ("ssl_ca_certs={key}", "the TLS options cannot be used"),  # a key, not a certificate
        ("ssl_certfile={cert}&ssl_keyfile={ca}", "the TLS options cannot be used"),
        ("ssl_ciphers=NO-SUCH-CIPHER", "the TLS options cannot be used: No cipher"),
    ],
)
def test_tls_options_that_cannot_be_used_are_refused_when_the_url_is_read(
    tls_files: dict[str, Path], query: str, says: str
):
    names = {name: str(path) for name, path in tls_files.items()}
    url = "rediss://:pw@h:6380/0?" + query.format(missing="/no/such/file.pem", **names)
    with pytest.raises(ValueError, match=says) as caught:
        parse_redis_url(url)
    assert "\n" not in str(caught.value) and "pw" not in str(caught.value)


def test_usable_tls_files_are_taken(tls_files: dict[str, Path]):
    files = f"ssl_ca_certs={tls_files['ca']}&ssl_certfile={tls_files['cert']}"
    url = f"rediss://h:6380/0?{files}&ssl_keyfile={tls_files['key']}&ssl_cert_reqs=required"
    assert parse_redis_url(url).tls


def test_an_encrypted_key_without_its_passphrase_is_one_line_not_a_prompt(
    tls_files: dict[str, Path], tmp_path: Path
):
    """OpenSSL once asked for the passphrase on the terminal (``serve --check`` and a start
    waited there), and without one the start said only ``[Errno 22] Invalid argument``."""
    key = serialization.load_pem_private_key(tls_files["key"].read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"hunter22"),
        )
    )
    url = f"rediss://h:6380/0?ssl_certfile={tls_files['cert']}&ssl_keyfile={encrypted}"
    done = subprocess.run(
        [sys.executable, "-m", "replystream", "serve", "--check", "--redis-url", url],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "replystream serve: --redis-url: ssl_keyfile: the key is encrypted: give its "
        "passphrase as ssl_password\n"
    )
    assert parse_redis_url(f"{url}&ssl_password=hunter22").tls
