"""An upstream's limit of requests at once held by every worker of ``serve --workers N``
together: one lock file per request at once, locked while a request uses it.

This file decides how a slot is taken, given back and counted. An upstream with a limit of L
has the files ``0`` to ``L-1`` in a folder of its own (named for its URL) inside the folder
all workers share; a request takes a slot with a non-blocking exclusive ``flock`` on one this
process does not hold, and gives it back by unlocking it. Why locks on files:
- the kernel drops every lock of a process that exits, however it exits (SIGKILL, the OOM
  killer), so a worker that dies cannot keep slots: nothing to clean up, no lease to expire;
- a ``flock`` belongs to an open file, not to a process (``fcntl`` locks do), so each worker
  opens each file once and the locks of two workers exclude each other; this process knows
  which of its own files it has locked, and never asks the kernel about those;
- a try that fails costs one system call, and nothing waits in the kernel: waiting for room
  is the relay's line's (``upstream_queue``), which polls ``free`` while it is not empty.
A process tries its files from the one after the slot it took last, so two workers do not
both start at slot 0. A limit lowered by a reload uses the first files only; the slots past
it still held (by requests under way) count against it until they are given back, as a
request under way counts in one process.

Deciding whether a request may go means trying slots: a try locks a free slot for the two
system calls it takes to lock and unlock it, and a worker taking a slot just then finds it
held (it tries the others; if none is free, it waits in its line and the next poll finds the
slot). Only requests and lines try slots, never a count for the metrics: that one reads the
kernel's table of locks (``/proc/locks``), which names each lock's file by its inode, and
counts the slot files locked there without touching a lock (``LockTable``); where there is
no such table it counts the slots this process holds.
It must not know HTTP, routing or the workers' parent; the folder is given to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from replystream.outage_log import OutageLog

log = logging.getLogger("replystream.upstream")

# How long a read of the table of locks is reused: the metrics count the slots taken once per
# row of theirs when they refresh, all within a moment.
TAKEN_FRESH_S = 0.1
# A line's file: when its first waiter began to wait, from when room is held for it (NaN:
# none is; see ``Lines.show``), and the model it is held for (its length, then its UTF-8 name,
# in one fixed record, so that one ``pwrite`` replaces it whole).
_LINE = struct.Struct("ddhH")
MODEL_BYTES = 1024
_RECORD = _LINE.size + MODEL_BYTES
NO_MODEL = -1  # the length that stands for a request for no model in particular (None)


LOCKS = Path("/proc/locks")


class LockTable:
    """The inodes of the files some process holds a ``flock`` on, read from the kernel's
    table of locks (``/proc/locks``) at most once per ``TAKEN_FRESH_S``: one read for the
    slots of every upstream. Reading it takes no lock, so it cannot keep a request from a
    slot. A file is named there by its device and inode; only the inode is compared, as on
    an overlay file system the table names the device underneath, not the one ``stat``
    says (a lock on a file of another file system with the same inode number would count:
    it touches a count for the metrics only)."""

    __slots__ = ("_clock", "_path", "_read")

    def __init__(self, clock: Callable[[], float] = time.monotonic, path: Path = LOCKS) -> None:
        self._clock = clock
        self._path = path
        self._read: tuple[float, frozenset[int] | None] = (-TAKEN_FRESH_S, None)

    def locked(self) -> frozenset[int] | None:
        """The inodes locked with ``flock`` now (None: the table cannot be read)."""
        now = self._clock()
        when, inodes = self._read
        if now - when < TAKEN_FRESH_S:
            return inodes
        try:
            text = self._path.read_text()
        except OSError:
            inodes = None
        else:
            inodes = frozenset(_flock_inodes(text))
        self._read = (now, inodes)
        return inodes


def _flock_inodes(table: str) -> list[int]:
    """The inodes of the ``flock`` locks held in ``table`` (``/proc/locks``: ``1: FLOCK
    ADVISORY WRITE 4242 fe:00:2146397 0 EOF``; a waiter's line, ``1: -> FLOCK ...``, holds
    nothing)."""
    inodes = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK":
            inode = fields[5].rpartition(":")[2]
            if inode.isdigit():
                inodes.append(int(inode))
    return inodes


class SlotFiles:
    """One upstream's slot files, as this process holds them."""

    __slots__ = ("_fds", "_folder", "_held", "_inodes", "_locks", "_next", "_retired")

    def __init__(
        self,
        folder: Path,
        clock: Callable[[], float] = time.monotonic,
        locks: LockTable | None = None,
    ) -> None:
        self._folder = folder
        # One per slot file, opened as a limit first needs it, or as the routes change.
        self._fds: list[int] = []
        self._inodes: list[int] = []  # each file's, as the table of locks names it
        self._held: set[int] = set()  # the slots this process holds
        self._next = 0  # where the next try starts
        self._retired = False  # its upstream left the routes: closed once none is held
        # Shared by the upstreams of one server (one read of the table for them all).
        self._locks = LockTable(clock) if locks is None else locks

    def _open(self, limit: int) -> None:
        if len(self._fds) < limit:
            self.open(limit)

    def open(self, limit: int) -> None:
        """Open the files of ``limit`` slots, and every other there is (the slots of a
        higher limit before: requests under way may hold them)."""
        self._folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        limit = max(limit, len(os.listdir(self._folder)))
        had = len(self._fds)
        try:
            while len(self._fds) < limit:
                path = self._folder / str(len(self._fds))
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._fds.append(fd)
                self._inodes.append(os.fstat(fd).st_ino)
        except OSError:
            # None of them kept: out of descriptors, a process that held them all would
            # accept no connection and open no upstream's.
            for fd in self._fds[had:]:
                os.close(fd)
            del self._fds[had:], self._inodes[had:]
            raise

    def _try(self, index: int) -> bool:
        try:
            fcntl.flock(self._fds[index], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _free_below(self, limit: int, most: int) -> int:
        """How many slots below ``limit`` no process holds (tried, up to ``most``)."""
        found = 0
        for index in range(limit):
            if found >= most:
                break
            if index not in self._held and self._try(index):
                fcntl.flock(self._fds[index], fcntl.LOCK_UN)
                found += 1
        return found

    def _held_past(self, limit: int) -> int:
        """How many slots from ``limit`` on some process still holds (a limit lowered while
        they were in use): none to try while the limit was never higher."""
        held = 0
        for index in range(limit, len(self._fds)):
            if index in self._held or not self._try(index):
                held += 1
            else:
                fcntl.flock(self._fds[index], fcntl.LOCK_UN)
        return held

    def take(self, limit: int) -> int | None:
        """A slot below ``limit`` that no process held, now this one's; None when every one
        is held, or when the slots held past a lowered limit fill the rest."""
        self._open(limit)
        past = self._held_past(limit)
        if past and self._free_below(limit, past + 1) <= past:
            return None
        start = self._next if self._next < limit else 0
        for step in range(limit):
            index = (start + step) % limit
            if index not in self._held and self._try(index):
                self._held.add(index)
                self._next = index + 1
                return index
        return None

    def give_back(self, index: int) -> None:
        """Give back a slot this process took (nothing once the files are closed)."""
        if index in self._held:
            self._held.discard(index)
            fcntl.flock(self._fds[index], fcntl.LOCK_UN)
            if self._retired and not self._held:
                self.close()

    def retire(self) -> None:
        """Its upstream left the routes: close the files now, or once the last slot this
        process holds is given back (an attempt under way there keeps its slot to its end)."""
        self._retired = True
        if not self._held:
            self.close()

    def free(self, limit: int, most: int) -> int:
        """How many requests more the upstream may be sent within ``limit`` now, counted
        over every process (tried, up to ``most``)."""
        self._open(limit)
        past = self._held_past(limit)
        return max(0, self._free_below(limit, most + past) - past)

    def taken(self, limit: int) -> int:
        """How many slots some process holds (this one's included), as the table of locks
        showed at most ``TAKEN_FRESH_S`` ago; without one, how many this process holds.
        Nothing is tried: a request taking a slot meanwhile finds it as free as it is."""
        self._open(limit)
        locked = self._locks.locked()
        if locked is None:
            return len(self._held)
        return sum(1 for inode in self._inodes if inode in locked)

    def close(self) -> None:
        """Close the files (which gives back every slot this process holds)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._inodes.clear()
        self._held.clear()


class Lines:
    """When the first request in each process's line for room began to wait, for the
    processes sharing the slots to compare: each holds an exclusive lock on a file of its own
    (``lines/PID-N``) while its line is not empty, with that time (``time.monotonic``, one
    clock for every process of the machine) in it; the others read it while they find it
    locked. When that first request needs room for several attempts at once (a request of
    several choices), the file also says from when room is held for it and for which model:
    past that time the other processes take no room it may use (``holding_elsewhere``), so
    the room it needs can gather. The kernel drops the lock of a process that dies, so its
    file says nothing any more; the next process to find it so removes it."""

    _made = 0  # lines made in this process (tests run several relays in one)

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        Lines._made += 1
        self._name = f"{os.getpid()}-{Lines._made}"
        self._fd: int | None = None
        self._others: dict[str, int] = {}
        self._shown: tuple[float, tuple[float, str | None] | None] | None = None

    def show(self, since: float | None, hold: tuple[float, str | None] | None = None) -> None:
        """Show when this process's first waiter began to wait (None: nobody waits), and, if
        room is held for it, from when and for which model (``hold``; a model whose name is
        longer than ``MODEL_BYTES`` in UTF-8 is shown with no hold)."""
        shown = None if since is None else (since, hold)
        if shown == self._shown:
            return
        if self._fd is None:
            self._folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = self._folder / self._name
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if since is not None:
            os.pwrite(self._fd, _record(since, hold), 0)
        if (since is None) != (self._shown is None):
            # Blocking: a process reading it holds its lock for three system calls at most.
            fcntl.flock(self._fd, fcntl.LOCK_UN if since is None else fcntl.LOCK_EX)
        self._shown = shown

    def oldest_elsewhere(self) -> float | None:
        """When the first waiter of the longest line elsewhere began to wait (None: no other
        process has anyone waiting)."""
        return min((since for since, _, _ in self._elsewhere()), default=None)

    def holding_elsewhere(self, now: float, before: float) -> list[str | None]:
        """The models room is held for at ``now`` by the lines of other processes whose
        first waiter began to wait ``before`` (a request that began earlier is not held up
        by one that began later: two such requests never hold room from each other)."""
        return [
            model
            for since, held_from, model in self._elsewhere()
            if held_from <= now and since < before
        ]

    def _elsewhere(self) -> list[tuple[float, float, str | None]]:
        """Each line of another process that has anyone waiting: when its first waiter began
        to wait, from when room is held for it (NaN: it is not), and for which model."""
        try:
            names = os.listdir(self._folder)
        except FileNotFoundError:
            return []
        lines: list[tuple[float, float, str | None]] = []
        for name in names:
            if name == self._name:
                continue
            fd = self._others.get(name)
            if fd is None:
                try:
                    fd = os.open(self._folder / name, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # removed meanwhile
                self._others[name] = fd
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # it has a line: when did it begin, and is room held?
                line = _line(os.pread(fd, _RECORD, 0))
                if line is not None:
                    lines.append(line)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._forget_if_gone(name, fd)
        return lines

    def _forget_if_gone(self, name: str, fd: int) -> None:
        pid = name.split("-", 1)[0]
        if not pid.isdigit():
            return
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                (self._folder / name).unlink()
            os.close(fd)
            del self._others[name]
        except PermissionError:
            pass

    def close(self) -> None:
        for fd in self._others.values():
            os.close(fd)
        self._others.clear()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                (self._folder / self._name).unlink()
            os.close(self._fd)
            self._fd = None
        self._shown = None


def _record(since: float, hold: tuple[float, str | None] | None) -> bytes:
    """A line's file: ``since``, and the hold if there is one it can show."""
    held_from, name = math.nan, b""
    length = 0
    if hold is not None:
        model = None if hold[1] is None else hold[1].encode()
        if model is None or len(model) <= MODEL_BYTES:
            held_from = hold[0]
            name, length = (b"", NO_MODEL) if model is None else (model, len(model))
    return _LINE.pack(since, held_from, length, 0) + name.ljust(MODEL_BYTES, b"\0")


def _line(record: bytes) -> tuple[float, float, str | None] | None:
    """What a line's file says (None: not a whole record, as in a file just made)."""
    if len(record) != _RECORD:
        return None
    since, held_from, length, _ = _LINE.unpack_from(record)
    if length == NO_MODEL:
        return since, held_from, None
    if not 0 <= length <= MODEL_BYTES:
        return None
    name = record[_LINE.size : _LINE.size + length].decode(errors="replace")
    return since, held_from, name


class SharedLimits:
    """Every upstream's slots, in ``folder`` (which the workers of one server share), and
    whether the workers' lines have anyone in them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._upstreams: dict[str, SlotFiles] = {}
        self._locks = LockTable()
        self.lines = Lines(folder / "lines")
        # A line polls the others' every few tens of milliseconds while anyone waits in it, and
        # each request reads them: a failure to (out of descriptors) is told as it begins and
        # as it ends, not at each read.
        self.lines_outage = OutageLog(log, "seeing the other workers' lines", level=logging.ERROR)

    def slots(self, name: str) -> SlotFiles:
        """The slots of the upstream at ``name`` (its base URL)."""
        files = self._upstreams.get(name)
        if files is None:
            # Named for the URL, in a form any URL can take as a file name.
            digest = "u" + hashlib.sha256(name.encode()).hexdigest()[:32]
            files = self._upstreams[name] = SlotFiles(self.folder / digest, locks=self._locks)
        return files

    def forget(self, name: str) -> None:
        """The upstream at ``name`` left the routes: its files are closed as its attempts
        under way end (each upstream taken out kept every worker's descriptors for good).
        Put back, it opens them again; slots still held then count against its limit."""
        files = self._upstreams.pop(name, None)
        if files is not None:
            files.retire()

    def close(self) -> None:
        for files in self._upstreams.values():
            files.close()
        self._upstreams.clear()
        self.lines.close()
