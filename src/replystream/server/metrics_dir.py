"""The folder the workers of ``--workers`` share their metrics through, and who owns it.

prometheus-client's multiprocess mode keeps each process's values in files of one folder
(``PROMETHEUS_MULTIPROC_DIR``). The workers share one more thing through it, in a folder of
its own inside (``SLOTS_FOLDER``): the relay's upstreams' slots of requests at once
(``engine/upstream_slots``), so that a limit holds for the whole server; they live and go
with the metrics; and one file, ``STOPPING_FILE``, once the whole server stops. The parent
makes a fresh one under the temp directory and removes it when it returns, but a parent
killed outright (SIGKILL, the OOM killer) cannot, and nothing else would. So the folder's
name says who owns it, and each parent, as it starts, removes the folders whose owners are
gone.

The owner is a process id and that process's start time (``/proc/PID/stat``), both in the
name, written when the folder is made (a file inside would leave a moment where a folder
has no owner yet, and another server starting then could take it for stale). The start time
is what tells a dead owner whose id the kernel gave to another process from a live one. A
folder is kept while its owner runs, or while any worker that wrote into it runs (the
workers of a killed parent take up to its shutdown grace to stop, and write their last
counts as they stop). Whatever cannot be told (no ``/proc``, a name of another form, another
user's folder) is kept: a folder left behind costs a few files, one removed under a live
server would lose its counts.

This file must not know what the metrics are, beyond the one count the parent keeps itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import values as prometheus_values
from prometheus_client.mmap_dict import MmapedDict

from replystream.server.metric_files import BackedMmapedDict, back_metric_files
from replystream.server.metrics import (
    MULTIPROCESS_DIR_ENV,
    WORKER_RESTARTS_HELP,
    WORKER_RESTARTS_NAME,
    files_held,
)

log = logging.getLogger("replystream.server")

FOLDER_PREFIX = "replystream-metrics-"
# Inside it: the upstreams' shared limits (not a metric file: prometheus-client reads *.db).
SLOTS_FOLDER = "upstream-slots"
# Inside it too: made by the parent as the whole server begins to stop, before it signals the
# workers, so that a worker stopping can tell that stop from one of its own (a SIGTERM sent to
# it alone, the others serving on).
STOPPING_FILE = "stopping"
# replystream-metrics-PID-STARTED-RANDOM (the random part is tempfile's).
_OWNED_FOLDER = re.compile(re.escape(FOLDER_PREFIX) + r"(\d+)-(\d+)-[^/]+")
# prometheus-client names each process's files KIND_PID.db (gauges KIND_MODE_PID.db).
_WRITER_FILE = re.compile(r"_(\d+)\.db")
# The files the counts of the workers that exited are added up in: KIND_gone.db, read by a
# scrape as one more process's (their name holds no process id: no writer of ``writers_of``).
GONE = "gone"
# What can be added up: counts (counters, histograms) and gauges summed over every worker
# that ever ran; those of live workers alone went with their worker (``mark_process_dead``).
_ADDED_UP = ("counter", "histogram", "gauge_sum")


@dataclass(frozen=True, slots=True)
class Owner:
    """The process that made a folder: its id, and when it started (clock ticks after boot,
    ``/proc/PID/stat``'s 22nd field; 0 where there is no ``/proc`` to read it from)."""

    pid: int
    started: int


def started_at(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None if ``/proc`` has no
    such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])  # field 22; the first after the name is field 3


def this_process() -> Owner:
    return Owner(os.getpid(), started_at(os.getpid()) or 0)


def process_exists(pid: int) -> bool:
    """Whether some process has id ``pid`` (perhaps another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_running(owner: Owner) -> bool:
    """Whether ``owner`` still runs: its id is taken, by a process that started when it did."""
    if not process_exists(owner.pid):
        return False
    started = started_at(owner.pid)
    # Without a start time on either side, a taken id counts as the owner's.
    return owner.started == 0 or started is None or started == owner.started


def owner_of(folder: Path) -> Owner | None:
    """The owner a folder's name gives; None for a name of another form."""
    found = _OWNED_FOLDER.fullmatch(folder.name)
    return Owner(int(found.group(1)), int(found.group(2))) if found else None


def writers_of(folder: Path) -> set[int]:
    """The ids of the processes that wrote metric files into ``folder``."""
    found = (_WRITER_FILE.search(name) for name in os.listdir(folder))
    return {int(match.group(1)) for match in found if match}


def is_stale(folder: Path) -> bool:
    """Whether ``folder`` is one of ours that nobody uses any more: made by a server that is
    gone, and written by no process that runs (a worker's id cannot be told from a reused one,
    so a taken id keeps the folder)."""
    owner = owner_of(folder)
    try:
        status = folder.lstat()
    except OSError:
        return False
    if owner is None or not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
        return False
    if is_running(owner):
        return False
    try:
        writers = writers_of(folder) - {owner.pid}  # the owner's own file: its start time told
    except OSError:
        return False
    return not any(process_exists(pid) for pid in writers)


def remove_stale_folders(parent: Path | None = None) -> list[Path]:
    """Remove the metrics folders that servers killed outright left in ``parent`` (default:
    the temp directory); return them."""
    where = parent if parent is not None else Path(tempfile.gettempdir())
    removed = []
    for folder in where.glob(FOLDER_PREFIX + "*"):
        if is_stale(folder):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
                log.warning("removed %s: the server that made it is gone", folder)
    return removed


@contextlib.contextmanager
def owned_folder() -> Iterator[str]:
    """A fresh metrics folder named for this process (see the module's note), removed on exit."""
    me = this_process()
    prefix = f"{FOLDER_PREFIX}{me.pid}-{me.started}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        os.mkdir(os.path.join(folder, SLOTS_FOLDER), 0o700)
        yield folder


def absorb(folder: str, pid: int) -> None:
    """Move the counts of worker ``pid``, which exited, into the files of the workers gone,
    and remove its files: the folder keeps a few files however often workers are started
    again, and a scrape reads those few. Held against scrapes (``files_held``), which see the
    counts either in its files or in those, never both or neither."""
    with files_held(folder, exclusive=True):
        for kind in _ADDED_UP:
            path = os.path.join(folder, f"{kind}_{pid}.db")
            try:
                values = list(MmapedDict.read_all_values_from_file(path))  # type: ignore[no-untyped-call]
            except FileNotFoundError:
                continue
            gone = BackedMmapedDict(os.path.join(folder, f"{kind}_{GONE}.db"))
            try:
                for key, value, timestamp, _ in values:
                    total = gone.read_value(key)[0] + value  # type: ignore[no-untyped-call]
                    gone.write_value(key, total, timestamp)  # type: ignore[no-untyped-call]
            finally:
                gone.close()  # type: ignore[no-untyped-call]
            os.remove(path)


def mark_stopping(folder: str) -> None:
    """The parent: the whole server stops now (``server_stops`` tells the workers)."""
    with contextlib.suppress(OSError):  # unsaid, a worker's /healthz answers as its own stop
        os.close(os.open(os.path.join(folder, STOPPING_FILE), os.O_CREAT | os.O_WRONLY, 0o600))


def server_stops(parent_pid: int) -> bool:
    """In a worker of ``--workers`` whose parent is ``parent_pid``: whether the whole server
    stops (the parent said so, or is gone), rather than this worker alone."""
    folder = os.environ.get(MULTIPROCESS_DIR_ENV)
    if folder is None or os.getppid() != parent_pid:
        return True
    return os.path.exists(os.path.join(folder, STOPPING_FILE))


def shared_slots_folder() -> Path | None:
    """In a worker of ``--workers``: the folder where the workers hold the upstreams' limits
    together (None in one process: it counts its own requests)."""
    folder = os.environ.get(MULTIPROCESS_DIR_ENV)
    return Path(folder) / SLOTS_FOLDER if folder else None


class RestartCount:
    """The parent's count of workers it started again, kept in the workers' folder.

    The parent serves no ``/metrics`` of its own; it writes this one counter into a file of
    its own in ``folder``, as one more process of the multiprocess mode would, and any
    worker's scrape adds it to the workers' own (each of which counts 0), so the count is
    ``replystream_worker_restarts_total`` whichever worker answers.
    """

    def __init__(self, folder: str) -> None:
        # prometheus-client reads the folder from the environment when a value is made, and
        # chose this process's value class when it was imported (before the folder existed).
        back_metric_files()
        previous = os.environ.get(MULTIPROCESS_DIR_ENV)
        os.environ[MULTIPROCESS_DIR_ENV] = folder
        try:
            value_class = prometheus_values.MultiProcessValue()  # type: ignore[no-untyped-call]
            self._value = value_class(
                "counter",
                WORKER_RESTARTS_NAME,
                WORKER_RESTARTS_NAME + "_total",
                (),
                (),
                WORKER_RESTARTS_HELP,
            )
        finally:
            if previous is None:
                del os.environ[MULTIPROCESS_DIR_ENV]
            else:
                os.environ[MULTIPROCESS_DIR_ENV] = previous

    def add_one(self) -> None:
        self._value.inc(1)
