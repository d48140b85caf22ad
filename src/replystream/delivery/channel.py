"""The hand-off between a generation and a handler that collects it whole (buffered replies).

A pump task reads the engine's deltas into a ``DeltaChannel``; the handler takes them out.
The channel also carries the generation's terminal state: finished, failed, or stopped from
outside (server shutdown), which does not wait for deltas still queued. Streamed replies do
not use it: their producer writes into the reply log (``server.replies``). This file must not
know about HTTP or event formats.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Literal

from replystream.engine.base import Delta, DeltaStream, EngineError

log = logging.getLogger("replystream.delivery")

Ending = Literal["finished", "failed", "shutdown"]


@dataclass(frozen=True, slots=True)
class End:
    """The last item a channel yields: how the generation ended."""

    how: Ending
    error: EngineError | None = None


class DeltaChannel:
    """A queue of deltas followed by one terminal ``End``."""

    def __init__(self) -> None:
        self._items: deque[Delta] = deque()
        self._end: End | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, delta: Delta) -> None:
        self._items.append(delta)
        self._wake()

    def close(self, end: End) -> None:
        """Record how the generation ended; the first ending recorded wins."""
        if self._end is None:
            self._end = end
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _next(self) -> Delta | End | None:
        if self._end is not None and self._end.how == "shutdown":
            return self._end  # shutdown does not wait for the backlog
        if self._items:
            return self._items.popleft()
        return self._end

    async def get(self) -> Delta | End:
        """The next delta, or the ending once every delta was taken."""
        while (item := self._next()) is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return item


async def pump(deltas: DeltaStream, channel: DeltaChannel) -> None:
    """Move every delta into ``channel``, then record how the generation ended.

    Cancelling this task is how a handler stops its generation: the ``finally`` closes the
    engine's stream, which frees what the request held.
    """
    try:
        async for delta in deltas:
            channel.put(delta)
    except EngineError as exc:
        channel.close(End("failed", exc))
    except Exception as exc:
        # A bug in an engine must still end the reply, not leave it hanging.
        log.exception("engine raised an unexpected error")
        channel.close(End("failed", EngineError(f"engine error: {exc}", code="internal_error")))
    else:
        channel.close(End("finished"))
    finally:
        await deltas.aclose()
