"""What each ``--redis-url`` form names, and what errors may show of it."""

from __future__ import annotations

import pytest

from replystream.delivery.redis_connect import RedisTarget, parse_redis_url


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
        "rediss://h/0?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required",
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
        ("redis://h/0?health_check_interval=soon", "Invalid value for 'health_check_interval'"),
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
