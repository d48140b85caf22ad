"""The parts of ``serve --workers``' supervision that need no server: the restart waits of a
worker's place, and which metrics folders count as left behind by a server that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from replystream.server import metrics_dir
from replystream.server.metrics_dir import Owner, is_running, owner_of, remove_stale_folders
from replystream.server.restart_backoff import Restart, RestartBackoff
from replystream.server.workers import how_it_ended


def test_restarts_in_a_row_wait_twice_as_long_each_up_to_the_cap():
    backoff = RestartBackoff(first_s=0.2, max_s=10.0, served_well_s=30.0)
    waits = [backoff.after_exit(None).delay_s for _ in range(9)]
    assert waits == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0])
    assert backoff.after_exit(5.0) == Restart(10.0, 10)  # served, but not long enough


def test_a_worker_that_served_well_starts_its_places_row_again():
    backoff = RestartBackoff(first_s=0.2, max_s=10.0, served_well_s=30.0)
    for _ in range(5):
        backoff.after_exit(None)
    assert backoff.after_exit(30.0) == Restart(0.2, 1)
    assert backoff.after_exit(1.0) == Restart(0.4, 2)


def test_a_place_failing_for_days_still_waits_the_cap():
    backoff = RestartBackoff(first_s=0.2, max_s=10.0, in_a_row=100_000)
    assert backoff.after_exit(None).delay_s == 10.0


def test_an_exit_reads_as_its_status_or_its_signal():
    assert how_it_ended(1) == "exited with status 1"
    assert how_it_ended(0) == "exited with status 0"
    assert how_it_ended(-9) == "was killed by SIGKILL"
    assert how_it_ended(-200) == "was killed by signal 200"


def dead_pid() -> int:
    """The id of a process that has exited (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def folder(where: Path, name: str, *writers: int) -> Path:
    path = where / name
    path.mkdir()
    for pid in writers:
        (path / f"counter_{pid}.db").write_bytes(b"")
    return path


def test_a_folder_made_here_is_owned_by_this_running_process(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    with metrics_dir.owned_folder() as made:
        owner = owner_of(Path(made))
        assert owner == metrics_dir.this_process() and owner.started > 0
        assert is_running(owner)
        assert remove_stale_folders(tmp_path) == []
    assert not Path(made).exists()


def test_only_folders_of_servers_that_are_gone_are_removed(tmp_path: Path):
    me = metrics_dir.this_process()
    gone, also_gone = dead_pid(), dead_pid()
    dead_owner = folder(tmp_path, f"replystream-metrics-{gone}-123-abc", gone, also_gone)
    # This process's id, but not its start time: the id was reused by another process.
    reused_id = folder(tmp_path, f"replystream-metrics-{me.pid}-{me.started + 1}-abc", me.pid)
    live_owner = folder(tmp_path, f"replystream-metrics-{me.pid}-{me.started}-abc")
    # The owner is gone, but a worker that wrote here still runs (stopping after it).
    live_writer = folder(tmp_path, f"replystream-metrics-{gone}-123-def", gone, me.pid)
    unknown_form = folder(tmp_path, "replystream-metrics-k2l4m9x1")
    not_a_folder = tmp_path / f"replystream-metrics-{gone}-123-ghi"
    not_a_folder.write_text("")

    removed = remove_stale_folders(tmp_path)

    assert sorted(removed) == sorted([dead_owner, reused_id])
    assert not dead_owner.exists() and not reused_id.exists()
    for kept in (live_owner, live_writer, unknown_form, not_a_folder):
        assert kept.exists(), kept


def test_a_process_without_a_start_time_counts_as_running_while_its_id_is_taken():
    assert is_running(Owner(os.getpid(), 0))
    assert not is_running(Owner(dead_pid(), 0))
