"""Shared fixtures: real servers on loopback sockets."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.server import create_app, running

# A process started with SIGINT ignored (a background job of a shell without job control,
# ``nohup``) passes that on to every process it starts: a test that sends a server Ctrl-C
# would find it ignored, and the server serving on. The suite takes Ctrl-C as Python does by
# default, and so do the processes it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Each test file's run time in a whole-suite run (``scripts/test_durations.py`` writes it).
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first. Workers take whole files in this order (``scripts/test``), so a
    file that takes a minute starts early instead of running alone at the end. A file the
    table does not know yet counts as a typical one (the median)."""
    seconds: dict[str, float] = json.loads(DURATIONS.read_text())
    typical = statistics.median(seconds.values())
    items.sort(key=lambda item: -seconds.get(item.path.name, typical))  # stable: files stay whole


ServeEngine = Callable[[SimulatedEngine], AbstractAsyncContextManager[str]]


def fast_engine(**overrides: object) -> SimulatedEngine:
    """A simulated engine with short delays so tests run quickly."""
    settings: dict[str, object] = {"delay_ms": 5.0, "jitter_ms": 1.0}
    settings.update(overrides)
    return SimulatedEngine(SimulatedConfig(**settings))  # type: ignore[arg-type]


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not within ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110  (polls state owned by another component)
            await asyncio.sleep(0.005)


@asynccontextmanager
async def serve_engine(engine: SimulatedEngine) -> AsyncIterator[str]:
    """Serve ``engine`` with the real app on a free loopback port; yield the base URL."""
    async with running(create_app(engine)) as url:
        yield url


@pytest.fixture
def serve() -> ServeEngine:
    return serve_engine


def our_code(error: Any) -> str:
    """Our code of a failed Responses object's ``error`` (JSON or the SDK's object): its
    ``code`` is one of OpenAI's, ours ends its message in parentheses."""
    code, message = (
        (error["code"], error["message"])
        if isinstance(error, dict)
        else (error.code, error.message)
    )
    assert code in ("server_error", "rate_limit_exceeded"), code
    assert message.endswith(")"), message
    return str(message[message.rindex("(") + 1 : -1])
