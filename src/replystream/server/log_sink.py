"""The server's log lines on stderr, written by a thread of their own.

A line written straight to stderr (``logging.StreamHandler``) is a blocking ``write``: once
the reader of a pipe stops reading (a stuck or slow log collector, a terminal paused with
Ctrl-S), the pipe's buffer (64 KiB on Linux) fills and the write waits, in the thread that
logged: the event loop's, so every stream, accept and timer of the process waits with it.
(Measured: with ``--log-level INFO`` and a pipe nobody read, the access-log line of the
272nd request froze the server, an open stream silent from then on.)

So each record is formatted where it is logged, as before, and its line queued; one daemon
thread writes the queue to the descriptor, whole lines in writes of at most ``PIPE_BUF``
bytes: the processes of ``--workers`` share one stderr, and a pipe keeps a write whole only up
to that size (a larger one goes in a part at a time as its reader makes room: another
worker's lines went into the middle of a line, and neither could be read). A line longer than
that is a write of its own. The queue is bounded (``MAX_PENDING_BYTES``): past it a line is
dropped and counted, and the next line written says how many were, so the reader sees where
its log has a gap (``dropped_lines`` counts them for the metrics). At exit the queue is
written for as long as the reader takes it, and given up after ``EXIT_WAIT_S`` in which it
took nothing: a stuck reader does not keep a stopping server from exiting.

It must not know about HTTP or replies.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import select
import threading
import time
from collections.abc import Iterator

# Lines waiting for the reader, at most: a minute or more of a busy access log, and a bound
# on what a reader that never comes back costs.
MAX_PENDING_BYTES = 4 * 1024 * 1024
# At exit, how long the queue waits for a reader that takes nothing before it is given up.
EXIT_WAIT_S = 1.0
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# The most a write to a pipe may hold and still go in whole, never interleaved with another
# process's writes (POSIX; 4096 bytes on Linux).
WHOLE_WRITE_BYTES = getattr(select, "PIPE_BUF", 512)


class ThreadedLineHandler(logging.Handler):
    """A handler whose lines a thread of its own writes to ``fd``: logging never waits for
    the reader, and a reader that cannot keep up loses lines, counted, not the server."""

    def __init__(self, fd: int, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        super().__init__()
        self._fd = fd
        self._max_pending = max_pending_bytes
        self._pending: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._dropped = 0  # since start
        self._unsaid = 0  # dropped since the last line written said so
        self._writing = False  # the thread holds lines it took and has not written yet
        self._written_at = time.monotonic()  # the reader last took a line
        self._wake = threading.Condition(threading.Lock())
        self._thread = threading.Thread(target=self._write_forever, name="log-writer", daemon=True)
        self._thread.start()

    @property
    def dropped_lines(self) -> int:
        """Lines dropped since start because the reader did not take them in time."""
        return self._dropped

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
        except Exception:  # a record whose message cannot be made: logging's own report
            self.handleError(record)
            return
        with self._wake:
            if self._pending_bytes + len(line) > self._max_pending:
                self._dropped += 1
                self._unsaid += 1
                return
            self._pending.append(line)
            self._pending_bytes += len(line)
            self._wake.notify()

    def _write_forever(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                lines = list(self._pending)
                self._pending.clear()
                self._pending_bytes = 0
                unsaid, self._unsaid = self._unsaid, 0
                self._writing = True
            if unsaid:
                lines.insert(0, self._said_dropped(unsaid))
            for piece in whole_lines(b"".join(lines), WHOLE_WRITE_BYTES):
                self._write(piece)
            with self._wake:
                self._writing = False
                self._wake.notify_all()

    def _said_dropped(self, unsaid: int) -> bytes:
        record = logging.LogRecord(
            "replystream.server",
            logging.WARNING,
            __file__,
            0,
            "%d log lines dropped: stderr was not read as fast as they came",
            (unsaid,),
            None,
        )
        return (self.format(record) + "\n").encode()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._fd, view)
            except InterruptedError:
                continue
            except OSError:  # the reader is gone (EPIPE) or the descriptor closed: nobody reads
                return
            view = view[written:]
            self._written_at = time.monotonic()

    def drain(self, idle_s: float = EXIT_WAIT_S) -> None:
        """Wait until every queued line is written, or the reader took nothing for ``idle_s``."""
        began = time.monotonic()
        with self._wake:
            while self._pending or self._writing:
                idle = time.monotonic() - max(began, self._written_at)
                if idle >= idle_s:
                    return
                self._wake.wait(min(0.05, idle_s - idle))


def whole_lines(data: bytes, most: int) -> Iterator[bytes]:
    """``data`` (lines, each ending with a line break) in pieces of whole lines, each at most
    ``most`` bytes, but for a line longer than that, which is a piece of its own."""
    start, size = 0, len(data)
    while size - start > most:
        end = data.rfind(b"\n", start, start + most) + 1
        if end == 0:  # (rfind found none: -1) a line longer than ``most``
            end = data.find(b"\n", start + most) + 1 or size
        yield data[start:end]
        start = end
    if start < size:
        yield data[start:]


_installed: ThreadedLineHandler | None = None


def install(level: int | str, fd: int = 2) -> None:
    """Log to ``fd`` (stderr) at ``level`` through a ``ThreadedLineHandler``, as
    ``logging.basicConfig`` would with a stream handler: only when the root logger has no
    handler yet (an embedding program's, or a test's, is kept)."""
    global _installed
    root = logging.getLogger()
    if root.handlers:
        return
    root.setLevel(level)
    handler = ThreadedLineHandler(fd)
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    _installed = handler
    atexit.register(handler.drain)


def drain() -> None:
    """Wait until the lines logged so far are written (bounded as at exit), so that what is
    printed next comes after them."""
    if _installed is not None:
        _installed.drain()


def dropped_lines() -> int:
    """Log lines dropped since start because stderr was not read in time (0 when another
    handler than ours writes the log)."""
    return 0 if _installed is None else _installed.dropped_lines
