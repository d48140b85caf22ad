"""Several choices from one request (``n > 1``): n generations, each its own, as one stream.

``start_choices`` admits the request n times, one after another, each told how many there
are (``choices``, so an engine that cannot run them all at once refuses the first) and which
request they are choices of (``group``, so an engine that must admit them together, a relay
taking room at its upstreams, knows them for one request), each with its own seed
(``seed + i``, where ``seed`` is the request's, else the one the engine settles for it once:
``Engine.seed_for``), so the choices differ and a request that gives a seed makes the same
choices again; an engine that picks no seed (a relay) gets every choice without one.
``ChoicesStream`` merges their deltas in the order they are made, each tagged with its
``choice``; it ends when every generation has ended, and fails as soon as one fails (closing
the others). ``close_choice(i)`` stops one generation early (its reply met a stop string)
while the others go on. A request for one choice never comes here: it pays nothing. Every
generation's stream is closed on every exit path. It must not know about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace

from replystream.engine.base import ChoiceGroup, Delta, DeltaStream, Engine, GenerationRequest
from replystream.engine.seeds import choice_seed


def choice_request(request: GenerationRequest, seed: int | None, index: int) -> GenerationRequest:
    """The request of choice ``index`` of a request sampled from ``seed``: the same, with its
    own seed (none when ``seed`` is None)."""
    if seed is None:
        return request
    return replace(request, sampling=replace(request.sampling, seed=choice_seed(seed, index)))


async def start_choices(engine: Engine, request: GenerationRequest, n: int) -> ChoicesStream:
    """Admit ``n`` generations of ``request``; if one is refused, close those admitted.

    Raises:
        RequestRejected, EngineError: as ``Engine.start`` does, for the first refused.
    """
    seed = engine.seed_for(request)  # once: a fresh seed's choices are seed + i as well
    request = replace(request, choices=n, group=ChoiceGroup())
    streams: list[DeltaStream] = []
    try:
        for index in range(n):
            streams.append(await engine.start(choice_request(request, seed, index)))
    except BaseException:
        for stream in streams:
            await _close(stream)
        raise
    return ChoicesStream(streams)


async def _close(stream: DeltaStream) -> None:
    with contextlib.suppress(Exception):
        await stream.aclose()


class ChoicesStream:
    """The deltas of several generations, merged as they are made (a ``DeltaStream``)."""

    def __init__(self, streams: Sequence[DeltaStream]) -> None:
        self._streams = list(streams)
        self._open = set(range(len(self._streams)))  # generations not yet ended or closed
        self._unclosed = set(self._open)  # every stream is closed once, however it ended
        self._closing: set[int] = set()  # asked to stop, not yet closed
        self._pending: dict[asyncio.Task[Delta], int] = {}  # the next delta of each, awaited
        self._merged = self._merge()

    def close_choice(self, index: int) -> None:
        """Stop generation ``index`` (the others go on): its awaited step is cancelled now,
        and its stream is closed before the next delta is taken."""
        if index in self._open:
            self._closing.add(index)
            for task, owner in self._pending.items():
                if owner == index:
                    task.cancel()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._merged

    async def __anext__(self) -> Delta:
        return await self._merged.__anext__()

    async def aclose(self) -> None:
        await self._merged.aclose()
        await self._shut()  # also when iteration never began

    async def _shut(self) -> None:
        for task in self._pending:
            task.cancel()
        for task in list(self._pending):
            with contextlib.suppress(BaseException):
                await task
        self._pending.clear()
        self._open.clear()
        for index in sorted(self._unclosed):
            await self._close(index)

    async def _close(self, index: int) -> None:
        if index in self._unclosed:
            self._unclosed.discard(index)
            await _close(self._streams[index])

    async def _merge(self) -> AsyncGenerator[Delta]:
        try:
            while self._open:
                for index in sorted(self._closing):
                    await self._stop(index)
                self._closing.clear()
                # One awaited step per open generation, not a task group: a task group cannot
                # stay open across this generator's yields. Every step is awaited here or
                # cancelled and awaited in ``_shut``, whatever ends the merge.
                waiting = set(self._pending.values())
                for index in self._open - waiting:
                    step = asyncio.ensure_future(anext(self._streams[index]))
                    self._pending[step] = index
                if not self._pending:
                    return
                done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
                # Several may be ready at once: in the order their generations were asked.
                for task in sorted(done, key=lambda t: self._pending[t]):
                    index = self._pending.pop(task)
                    if task.cancelled() or index in self._closing:
                        continue  # stopped by ``close_choice``: closed at the top of the loop
                    try:
                        delta = task.result()
                    except StopAsyncIteration:
                        self._open.discard(index)
                        await self._close(index)
                        continue
                    yield delta._replace(choice=index)
        finally:
            await self._shut()

    async def _stop(self, index: int) -> None:
        for task, owner in list(self._pending.items()):
            if owner == index:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                del self._pending[task]
        self._open.discard(index)
        await self._close(index)
