"""A result file cut short by Ctrl-C is not left behind looking whole.

``bench --csv`` writes one row per request, which takes a while for a long run; a Ctrl-C
landing among the rows used to leave the header and the rows before it, a file that reads
as a complete run of fewer requests, in place of the one an earlier run wrote there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replystream.lab.bench_csv import write_csv
from replystream.lab.whole_file import write_text_whole


class CtrlCWhenWritten(float):
    """A timing whose writing meets a Ctrl-C, as a SIGINT among the rows does."""

    def __repr__(self) -> str:
        raise KeyboardInterrupt

    __str__ = __repr__


def _result(ttfts: list[float]) -> dict[str, Any]:
    requests = [{"ttft_ms": ttft, "complete": True, "resume": None} for ttft in ttfts]
    return {"config": {"profile": "synchronous", "rate": None}, "requests": requests}


def test_csv_interrupted_among_its_rows_leaves_the_earlier_file(tmp_path: Path) -> None:
    path = tmp_path / "run.csv"
    write_csv(_result([10.0, 11.0]), path)
    earlier = path.read_text()
    with pytest.raises(KeyboardInterrupt):
        write_csv(_result([12.0, 13.0, CtrlCWhenWritten(14.0), 15.0]), path)
    assert path.read_text() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.csv"]  # no partial file


def test_csv_interrupted_with_no_earlier_file_leaves_none(tmp_path: Path) -> None:
    path = tmp_path / "run.csv"
    with pytest.raises(KeyboardInterrupt):
        write_csv(_result([12.0, CtrlCWhenWritten(14.0)]), path)
    assert list(tmp_path.iterdir()) == []


def test_a_whole_file_replaces_the_earlier_one_through_a_link(tmp_path: Path) -> None:
    real = tmp_path / "kept.json"
    real.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text_whole(link, "new\n")
    assert link.is_symlink()
    assert real.read_text() == "new\n"


def test_what_is_no_regular_file_is_written_in_place() -> None:
    write_csv(_result([10.0]), Path("/dev/null"))  # nothing made beside it in /dev
    assert not list(Path("/dev").glob(".null.*.part"))
