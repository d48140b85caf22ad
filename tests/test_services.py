"""A missing service binary skips a test, except where CI requires every service."""

from __future__ import annotations

import socket

import pytest

from tests.services import REQUIRE_ENV, free_port, require_binary

MISSING = "replystream-no-such-binary"


def test_missing_binary_skips_with_the_package_to_install(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="Debian package nginx"):
        require_binary(MISSING, debian_package="nginx")


def test_missing_binary_fails_when_services_are_required(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=REQUIRE_ENV):
        require_binary(MISSING)


def test_free_port_can_be_bound():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
