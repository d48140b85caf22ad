"""The lab's progress bars: on stderr, gone once the work is done, and silent where unseen.

A bar is for a person at a terminal. Rich writes an empty line when a bar stops on a console
that is not interactive, even a disabled one, so a command's one-line error (or a CI log) would
begin with a blank line; here a bar that was never shown writes nothing at all.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)


class _SilentWhenHidden(Progress):
    def stop(self) -> None:
        if not self.disable:
            super().stop()


def progress_bar(title: str, *columns: ProgressColumn, quiet: bool) -> Progress:
    """A transient bar: ``title`` (Rich markup), the bar, done of total, ``columns``, the
    time elapsed; hidden when ``quiet`` or when stderr is not a terminal."""
    console = Console(stderr=True)
    return _SilentWhenHidden(
        TextColumn(title),
        BarColumn(),
        MofNCompleteColumn(),
        *columns,
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )
