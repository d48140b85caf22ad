"""What every stream of the load client keeps, whatever its transport, and how one ends.

A transport (SSE in ``loadclient.py``, WebSocket in ``wsclient.py``) subclasses ``Stream``:
it writes its request, calls ``opened`` when the server has accepted the stream (response
headers, or the WebSocket upgrade), appends token arrivals, and ends through ``finish``. The
counters of one run live in ``Run``. Nothing here reads bytes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import cast


class Run:
    """Counters shared by every stream of one run."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.open = 0
        self.peak_open = 0
        self.ended = 0
        self.retries = 0
        self.failures: Counter[str] = Counter()
        self.all_ended = asyncio.Event()

    def end(self) -> None:
        self.ended += 1
        if self.ended == self.streams:
            self.all_ended.set()


class Stream(asyncio.Protocol):
    """One streamed reply's timings: when it connected, asked, and each token arrived."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.connected = math.nan  # the TCP connection made
        self.sent = math.nan  # the request for the reply written: token due times count from here
        self.in_body = False  # accepted by the server and not ended: counted as open
        self.arrivals: list[float] = []
        self.done_at = math.nan
        self.failure: str | None = None
        self.ended = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.connected = self.sent = time.perf_counter()
        self.transport_ready()

    def transport_ready(self) -> None:
        """Write what the transport writes first (the request, or the upgrade)."""
        raise NotImplementedError

    def opened(self) -> None:
        """The server accepted the stream: it counts as open until it ends."""
        self.in_body = True
        run = self.run
        run.open += 1
        if run.open > run.peak_open:
            run.peak_open = run.open

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended:
            self.finish(f"closed before done: {exc!r}" if exc else "closed before done")

    def finish(self, failure: str | None) -> None:
        self.ended = True
        self.failure = failure
        if self.in_body:
            self.run.open -= 1
        if failure is not None:
            self.run.failures[failure] += 1
            if self.transport is not None:
                self.transport.close()
        self.run.end()
