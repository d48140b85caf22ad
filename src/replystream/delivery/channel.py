"""The bounded hand-off between a generation and the code that writes it to a socket.

A pump task reads the engine's deltas into a ``DeltaChannel``; the writer takes them out with
a timeout (so it can flush a batch window or send a keep-alive while nothing arrives).
Generation does not wait for a slow socket; instead the channel counts the bytes of text
waiting in it, and the writer cuts a stream whose backlog passes the slow-client limit.
The channel also carries the stream's terminal state: finished, failed, or stopped from
outside (server shutdown). This file must not know about HTTP or event formats.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
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


TIMEOUT = object()  # what ``get`` returns when nothing arrived in time


class DeltaChannel:
    """A queue of deltas with byte accounting, one terminal ``End``, and an interrupt.

    ``interrupt`` is how the producer side or the server reaches a writer that is blocked on a
    socket: the writer sets ``on_interrupt`` while it waits, and an overflow or a shutdown
    calls it.
    """

    def __init__(self, limit_bytes: int = 1 << 20) -> None:
        self._items: deque[Delta] = deque()
        self._end: End | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.limit_bytes = limit_bytes
        self.queued_bytes = 0
        self.overflowed = False
        self.on_interrupt: Callable[[], None] | None = None

    def put(self, delta: Delta) -> None:
        self._items.append(delta)
        self.queued_bytes += len(delta.text)
        if self.queued_bytes > self.limit_bytes and not self.overflowed:
            self.overflowed = True
            self.interrupt()
        self._wake()

    def close(self, end: End) -> None:
        """Record how the generation ended; the first ending recorded wins."""
        if self._end is None:
            self._end = end
            if end.how == "shutdown":
                self.interrupt()
            self._wake()

    def interrupt(self) -> None:
        if self.on_interrupt is not None:
            self.on_interrupt()

    @property
    def ended(self) -> bool:
        return self._end is not None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> Delta | End | None:
        """The next delta, else the ending once every delta was taken, else None."""
        if self._end is not None and self._end.how == "shutdown":
            return self._end  # shutdown does not wait for the backlog
        if self._items:
            delta = self._items.popleft()
            self.queued_bytes -= len(delta.text)
            return delta
        return self._end

    async def get(self, wait_s: float | None) -> Delta | End | object:
        """The next delta or the ending; ``TIMEOUT`` if nothing came within ``wait_s``."""
        item = self.get_nowait()
        if item is not None:
            return item
        if wait_s is not None and wait_s <= 0:
            return TIMEOUT
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            if wait_s is None:
                await self._waiter
            else:
                async with asyncio.timeout(wait_s):
                    await self._waiter
        except TimeoutError:
            return TIMEOUT
        finally:
            self._waiter = None
        return self.get_nowait()


async def pump(deltas: DeltaStream, channel: DeltaChannel) -> None:
    """Move every delta into ``channel``, then record how the generation ended.

    Cancelling this task is how a stream stops its generation: the ``finally`` closes the
    engine's stream, which frees what the request held.
    """
    try:
        async for delta in deltas:
            channel.put(delta)
    except EngineError as exc:
        channel.close(End("failed", exc))
    except Exception as exc:
        # A bug in an engine must still end the reply in-band, not leave it hanging.
        log.exception("engine raised an unexpected error")
        channel.close(End("failed", EngineError(f"engine error: {exc}", code="internal_error")))
    else:
        channel.close(End("finished"))
    finally:
        await deltas.aclose()
