"""The turns the running event loop takes while a test's code runs: a task of its own counts
them, so a test can tell that long work gave the loop back (other streams' turns)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


@contextlib.asynccontextmanager
async def counted_turns() -> AsyncIterator[Callable[[], int]]:
    """Yield a function that tells how many turns the loop has taken since the block began."""
    turns = 0

    async def count() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    counter = asyncio.create_task(count())
    await asyncio.sleep(0)  # the counter waits for its first turn
    began = turns
    try:
        yield lambda: turns - began
    finally:
        counter.cancel()
