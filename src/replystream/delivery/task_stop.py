"""Stopping a task for good, even when a library loses the cancel.

On Python 3.11, ``asyncio.wait_for`` returns the awaited result when it completes in the
same turn as a cancel, and the cancel is lost (fixed in 3.12). redis-py sends every
command through ``wait_for``: a task cancelled while a command's reply arrives goes on
running, in the "cancelling" state, and one cancel never ends it. Closing code that awaits
such a task after one ``cancel()`` can wait forever (``stop_task`` cancels until it ends);
a task cancelled once by someone who does not wait for it (aiohttp cancels a request's
handler when its client disconnects) must notice the lost cancel itself
(``end_if_cancelled``). A task let go of without waiting is cancelled if it runs, or has its
outcome taken if it ended, so its failure is not logged as never retrieved (``drop_task``).
A cancelled task keeps its ``CancelledError`` until someone asks for it, and that error's
traceback holds the task's frames, whose locals often hold the task: a cycle only a full
collection frees, which the server's collector settings (``serve.tune_collector``) make
rare, with all the task held (a reply and its log). Every task let go of here has that error
taken (``forget_cancellation``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

# How long a cancelled task is given to end before it is cancelled again: a lost cancel
# costs at most this much.
RECANCEL_S = 0.05


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` until it has ended, and wait for that; its outcome is dropped."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if task.cancelled():
        forget_cancellation(task)
    else:
        with contextlib.suppress(Exception):
            task.result()


def drop_task(task: asyncio.Future[Any]) -> None:
    """Let go of ``task`` without waiting: cancel it if it runs, or take its outcome if it
    has ended, so a failure of it is not logged as a task exception nobody retrieved. (A
    client's reset fails a write in the same turn as it cancels the handler waiting for it.)"""
    if not task.done():
        task.cancel()
        task.add_done_callback(forget_cancellation)
    elif task.cancelled():
        forget_cancellation(task)
    else:
        task.exception()


def forget_cancellation(task: asyncio.Future[Any]) -> None:
    """Take a cancelled task's ``CancelledError`` (a done callback, or once it has ended), so
    that the task no longer holds it, nor through it the frames that hold the task."""
    if task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.exception()


def end_if_cancelled() -> None:
    """Raise ``CancelledError`` in a task that was cancelled and runs on as if it had not
    been (a library lost the cancel). Called where a long-running task goes round its loop,
    outside any handling of a cancel: there, a pending request means one was lost."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
