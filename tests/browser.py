"""Browser tests' tools: headless Chromium, a loopback proxy that can cut connections, and an
engine that records its own timings.

Chromium is Debian's ``chromium`` package driven by Playwright with the system binary; the
tests never download a browser. Missing either one skips the test with the reason, unless
``REPLYSTREAM_REQUIRE_SERVICES=1`` (CI), where it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import pytest

from replystream.engine.base import (
    Delta,
    DeltaStream,
    EngineStats,
    GenerationRequest,
    Readiness,
)
from replystream.engine.simulated import SimulatedEngine
from tests.services import REQUIRE_ENV, require_binary, services_required

if TYPE_CHECKING:
    from playwright.async_api import Browser

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _skip_or_fail(reason: str) -> NoReturn:
    if services_required():
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires it")
    pytest.skip(reason)


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Headless Chromium (the system binary) under Playwright; skips when either is missing."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _skip_or_fail("playwright is not installed (pip install playwright)")
    executable = require_binary("chromium", debian_package="chromium")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


class LoopbackProxy:
    """A TCP proxy on loopback in front of ``upstream``; `cut` drops every open connection,
    `stall` leaves them open but passes nothing more on them (a path that lost them: the
    peer gone into a tunnel, a NAT that forgot the flow).

    It also keeps the bytes each client sent, so a test can see the requests the browser made
    (the headers of a reconnect, for instance).
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._stalled: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = bytearray()
        self.url = ""

    async def __aenter__(self) -> LoopbackProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def cut(self) -> None:
        """Reset every connection open now; new ones are still accepted."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def stall(self) -> None:
        """Pass nothing more on the connections open now, either way, and keep them open;
        new ones pass freely."""
        self._stalled |= self._writers

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        pipes = [
            asyncio.ensure_future(self._pipe(reader, up_writer, record=True)),
            asyncio.ensure_future(self._pipe(up_reader, writer, record=False)),
        ]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
                self._tasks.discard(pipe)
            for end in (writer, up_writer):
                self._writers.discard(end)
                self._stalled.discard(end)
                end.transport.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, record: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while chunk := await reader.read(65536):
                if writer in self._stalled:
                    continue  # read and dropped: the sender is not held up, nothing arrives
                if record:
                    self.sent += chunk
                writer.write(chunk)
                await writer.drain()


@dataclass
class ReplyTimes:
    """One generation as the engine saw it, in ``time.monotonic()`` seconds."""

    started: float
    token_times: list[float] = field(default_factory=list)

    @property
    def first_token_s(self) -> float:
        return self.token_times[0] - self.started

    @property
    def last_token_s(self) -> float:
        return self.token_times[-1] - self.started


class TimedEngine:
    """A simulated engine that records when each generation started and made each token."""

    name = "simulated"
    pushes = False  # its streams are its own generators around the inner engine's
    queues = False
    makes_tool_calls = False
    follows_response_format = False

    def __init__(self, inner: SimulatedEngine) -> None:
        self.inner = inner
        self.replies: list[ReplyTimes] = []

    async def start(self, request: GenerationRequest) -> DeltaStream:
        times = ReplyTimes(time.monotonic())
        deltas = await self.inner.start(request)
        self.replies.append(times)
        return self._follow(deltas, times)

    async def _follow(self, deltas: DeltaStream, times: ReplyTimes) -> AsyncGenerator[Delta]:
        try:
            async for delta in deltas:
                times.token_times.append(delta.made_at)
                yield delta
        finally:
            await deltas.aclose()

    def seed_for(self, request: GenerationRequest) -> int | None:
        return self.inner.seed_for(request)

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def count_prompt(self, request: GenerationRequest) -> int:
        return self.inner.count_prompt(request)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def model_names(self) -> tuple[str, ...]:
        return self.inner.model_names()

    def default_model(self) -> str | None:
        return self.inner.default_model()

    def passes_unlisted_models(self) -> bool:
        return self.inner.passes_unlisted_models()

    async def readiness(self) -> Readiness:
        return await self.inner.readiness()

    async def aclose(self) -> None:
        await self.inner.aclose()
