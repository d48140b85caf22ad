"""A measuring run's first Ctrl-C stops it and keeps what ended, as load tools do.

``bench`` and ``lab`` both take the first Ctrl-C (and SIGTERM, which the command line turns
into one) as "stop and report what you have"; a second one stops at once.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def on_ctrl_c(work: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """``work(interrupt)``, with the first Ctrl-C setting ``interrupt``: the run stops and
    what ended is reported. A second Ctrl-C stops at once."""
    loop = asyncio.get_running_loop()
    interrupt = asyncio.Event()

    def first() -> None:
        interrupt.set()
        # Python's own handler again: the next Ctrl-C raises KeyboardInterrupt (exit 130).
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, first)
    except (RuntimeError, ValueError):  # not the main thread (called from a program)
        return await work(interrupt)
    try:
        return await work(interrupt)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def unless_interrupted(
    interrupt: asyncio.Event | None, work: Coroutine[Any, Any, object]
) -> bool:
    """Await ``work``, or cancel it once ``interrupt`` is set; True if it was cancelled.

    What ``work`` raises is raised as it is (not in an exception group), so a caller's
    ``except`` catches it.
    """
    if interrupt is None:
        await work
        return False
    working = asyncio.ensure_future(work)
    waiting = asyncio.ensure_future(interrupt.wait())
    try:
        await asyncio.wait((working, waiting), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        cut = not working.done()
        working.cancel()
        # Its own clean-up runs to its end before the run goes on (or stops).
        await asyncio.wait((working, waiting))
    if not cut:
        working.result()  # what it raised
    return cut
