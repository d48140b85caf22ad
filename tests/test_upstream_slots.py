"""The slot files the workers of one server hold an upstream's limit with, and the lines they
show each other: two ``SlotFiles`` on one folder are two processes' views (a ``flock``
belongs to an open file, so they exclude each other as two processes' would)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest

from replystream.engine.upstream_slots import LOCKS, Lines, LockTable, SharedLimits, SlotFiles


def test_two_holders_of_one_folder_take_no_more_slots_than_the_limit_together(tmp_path: Path):
    one, other = SlotFiles(tmp_path), SlotFiles(tmp_path)
    assert one.take(3) is not None and one.take(3) is not None
    taken = other.take(3)
    assert taken is not None
    assert other.take(3) is None and one.take(3) is None
    assert one.free(3, 3) == other.free(3, 3) == 0
    assert one.taken(3) == 3
    other.give_back(taken)
    assert one.free(3, 3) == 1
    assert one.take(3) == taken  # the one given back, whoever held it


def test_slots_held_past_a_lowered_limit_count_against_it(tmp_path: Path):
    one, other = SlotFiles(tmp_path), SlotFiles(tmp_path)
    held = [other.take(3), other.take(3)]  # slots 0 and 1, under a limit of 3
    assert None not in held
    one.open(1)  # the limit is 1 now: both still held, both count
    assert one.take(1) is None and one.free(1, 1) == 0
    other.give_back(0)
    assert one.take(1) is None  # slot 1 is still held past the limit: 1 at once already
    other.give_back(1)
    assert one.take(1) == 0


def test_a_process_that_dies_holding_slots_leaves_them_free(tmp_path: Path):
    script = (
        "import sys, time; from pathlib import Path;"
        "from replystream.engine.upstream_slots import SlotFiles;"
        "s = SlotFiles(Path(sys.argv[1])); s.take(2); s.take(2);"
        "print('held', flush=True); time.sleep(60)"
    )
    with subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=PIPE) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            here = SlotFiles(tmp_path)
            assert here.take(2) is None
            holder.kill()  # as SIGKILL or the OOM killer ends a worker
            holder.wait()
            assert here.take(2) is not None and here.take(2) is not None
        finally:
            holder.kill()


def test_a_line_shows_the_room_held_for_its_first_waiter_from_when_and_for_which_model(
    tmp_path: Path,
):
    one, other = Lines(tmp_path), Lines(tmp_path)
    other.show(10.0, (12.0, "qwen"))  # a request of several choices, starving from 12.0
    assert one.oldest_elsewhere() == 10.0 and one.holding_elsewhere(11.9, 13.0) == []
    assert one.holding_elsewhere(12.0, 13.0) == ["qwen"]
    assert other.holding_elsewhere(12.0, 13.0) == []  # its own line holds nothing from it
    # A request that began to wait before it (at 9.0) is not held up by it.
    assert one.holding_elsewhere(12.0, 9.0) == []
    other.show(10.0, (12.0, None))  # a request for no model in particular
    assert one.holding_elsewhere(12.5, 13.0) == [None]
    other.show(10.0, (12.0, "ü" * 300))  # not ASCII, and long: shown as it is
    assert one.holding_elsewhere(12.5, 13.0) == ["ü" * 300]
    other.show(10.0, (12.0, "m" * 1025))  # longer than a record holds: shown with no hold
    assert one.oldest_elsewhere() == 10.0 and one.holding_elsewhere(12.5, 13.0) == []
    other.show(11.0)  # served: the next in line needs no more than one room
    assert one.oldest_elsewhere() == 11.0 and one.holding_elsewhere(12.5, 13.0) == []
    other.show(None)
    assert one.holding_elsewhere(12.5, 13.0) == []
    one.close()
    other.close()


def test_lines_show_when_their_first_waiter_began_and_a_dead_ones_file_goes(tmp_path: Path):
    one, other = Lines(tmp_path), Lines(tmp_path)
    assert one.oldest_elsewhere() is None
    other.show(12.5)
    assert one.oldest_elsewhere() == 12.5 and other.oldest_elsewhere() is None
    other.show(13.0)  # its first waiter left: the next one's time
    assert one.oldest_elsewhere() == 13.0
    other.show(None)
    assert one.oldest_elsewhere() is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{dead.pid}-1"  # a line file whose process is gone (unlocked)
    stale.write_bytes(b"")
    assert one.oldest_elsewhere() is None and not stale.exists()
    assert os.listdir(tmp_path)  # the living lines' files stay
    one.close()
    other.close()
    assert os.listdir(tmp_path) == []


def test_a_count_of_the_slots_taken_is_reused_only_for_a_moment(tmp_path: Path):
    now = [0.0]
    one, other = SlotFiles(tmp_path, clock=lambda: now[0]), SlotFiles(tmp_path)
    assert one.taken(2) == 0
    assert other.take(2) is not None
    assert one.taken(2) == 0  # counted a moment ago
    now[0] += 0.2
    assert one.taken(2) == 1


@pytest.mark.skipif(not LOCKS.exists(), reason="the kernel's table of locks is Linux's")
def test_counting_the_slots_taken_never_keeps_a_request_from_a_free_slot(tmp_path: Path):
    # Another process counts the slots taken (a worker answering a metrics scrape) as fast
    # as it can, never reusing a count, while this one takes and gives back the only slot.
    script = (
        "import itertools, sys; from pathlib import Path;"
        "from replystream.engine.upstream_slots import SlotFiles;"
        "tick = itertools.count(0, 1.0);"
        "s = SlotFiles(Path(sys.argv[1]), clock=lambda: next(tick)); seen = set();"
        "print('counting', flush=True)\n"
        "while len(seen) < 2 or not Path(sys.argv[2]).exists(): seen.add(s.taken(1))\n"
        "print(sorted(seen), flush=True)"
    )
    done = tmp_path / "done"
    slots = tmp_path / "slots"
    with subprocess.Popen(
        [sys.executable, "-c", script, str(slots), str(done)], stdout=PIPE
    ) as counter:
        try:
            assert counter.stdout is not None and counter.stdout.readline() == b"counting\n"
            here = SlotFiles(slots)
            refused, tries, until = 0, 0, time.monotonic() + 1.0
            while time.monotonic() < until:
                tries += 1
                index = here.take(1)
                if index is None:
                    refused += 1
                else:
                    here.give_back(index)
            done.touch()
            # It saw the slot both free and taken: it read the real files all along.
            assert counter.stdout.readline() == b"[0, 1]\n"
            assert refused == 0, f"refused {refused} of {tries}"
        finally:
            counter.kill()


@pytest.mark.skipif(not LOCKS.exists(), reason="the kernel's table of locks is Linux's")
def test_without_a_table_of_locks_the_count_is_of_the_slots_this_process_holds(tmp_path: Path):
    slots = tmp_path / "slots"
    blind = SlotFiles(slots, locks=LockTable(path=tmp_path / "no-such-table"))
    other = SlotFiles(slots)
    assert other.take(3) is not None
    assert blind.take(3) is not None
    assert blind.taken(3) == 1  # its own; the other's cannot be seen without trying it
    assert other.taken(3) == 2  # read from the kernel's table


def test_slot_files_past_the_open_files_allowed_are_all_closed_again(tmp_path: Path):
    """Out of descriptors half-way, the files opened so far were kept: the process then had
    none left for a connection. None is kept, and a limit that fits opens as before."""
    script = (
        "import os, resource, sys\n"
        "from pathlib import Path\n"
        "from replystream.engine.upstream_slots import SlotFiles\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "slots = SlotFiles(Path(sys.argv[1]))\n"
        "before = len(os.listdir('/proc/self/fd'))\n"
        "try:\n"
        "    slots.open(1000)\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
        "print(len(os.listdir('/proc/self/fd')) - before)\n"
        "print(slots.take(2) is not None and slots.take(2) is not None and slots.take(2) is None)\n"
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "slots")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["24", "0", "True"], done.stdout  # EMFILE; none kept


def test_an_upstream_taken_out_closes_its_files_once_its_last_slot_is_given_back(
    tmp_path: Path,
):
    shared = SharedLimits(tmp_path)
    gone = shared.slots("http://gone/v1")
    held = gone.take(3)
    assert held is not None
    before = len(os.listdir("/proc/self/fd"))
    shared.forget("http://gone/v1")  # a reply under way there keeps its slot
    assert len(os.listdir("/proc/self/fd")) == before
    back = shared.slots("http://gone/v1")  # put back while it runs: it still counts
    assert back is not gone and back.free(3, 3) == 2
    gone.give_back(held)
    assert back.free(3, 3) == 3
    assert len(os.listdir("/proc/self/fd")) == before  # the first's 3 closed, its own 3 open
    shared.close()
