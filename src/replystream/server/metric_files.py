"""Metric files whose every page has its disk blocks before it is written.

prometheus-client's multiprocess mode keeps each process's values in a file it maps into
memory (``MmapedDict``), made and grown by truncation: a sparse file, whose pages get their
blocks only when first written. On a filesystem with no room left (a full ``/tmp``), such a
write cannot be backed and the kernel kills the writing process with SIGBUS: under
``--workers`` a worker at its next new metric row, then the parent adding its counts up,
and so the whole server, with nothing said. Allocating the blocks first
(``posix_fallocate``) turns the same shortage into an ``OSError`` (ENOSPC) where the file is
made or grown, which the code there can tell and survive.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import IO, Any

from prometheus_client import values as prometheus_values
from prometheus_client.mmap_dict import MmapedDict

# The size prometheus-client gives a new file (``mmap_dict._INITIAL_MMAP_SIZE``).
INITIAL_SIZE = 1 << 16


class _AllocatingFile:
    """The file object ``MmapedDict`` grows by ``truncate``: grown by allocation instead."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file

    def truncate(self, size: int) -> None:
        os.posix_fallocate(self._file.fileno(), 0, size)

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


class BackedMmapedDict(MmapedDict):
    """``MmapedDict`` over a file whose blocks are allocated before any page is written."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:
            fd = os.open(filename, os.O_RDWR | os.O_CREAT, 0o600)
            try:  # a new file's first page is written as it is opened
                size = os.fstat(fd).st_size
                os.posix_fallocate(fd, 0, max(size, INITIAL_SIZE))
            except OSError as exc:  # (posix_fallocate names no file)
                if size == 0:  # made here: no file of no values left for a scrape to read
                    os.unlink(filename)
                raise OSError(exc.errno, exc.strerror, filename) from None
            finally:
                os.close(fd)
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]
        if not read_mode:
            self._f: Any = _AllocatingFile(self._f)


def back_metric_files() -> None:
    """Have this process's multiprocess metric files made as ``BackedMmapedDict``s (the
    class ``prometheus_client.values`` makes them of); idempotent."""
    prometheus_values.MmapedDict = BackedMmapedDict  # type: ignore[attr-defined]


def make_metric_files(folder: str, kinds: Iterable[str]) -> None:
    """Make this process's file of each kind (``counter``, ``gauge_livesum``...) in
    ``folder`` now, as it starts: made later, at a reply's first metric of its kind, a
    filesystem with no room left would fail that reply."""
    for kind in kinds:
        BackedMmapedDict(os.path.join(folder, f"{kind}_{os.getpid()}.db")).close()  # type: ignore[no-untyped-call]
