"""Where the lab's reports are printed: a console as wide as its output allows.

A terminal keeps its own width (its user chose it). Anything else (a pipe, a file, a CI log)
has no width, and Rich would assume 80 columns and cut or wrap the tables; there the console
is as wide as any report needs, so a table reads the same in a log as on a screen. A reader
that leaves (``| head``) stops the report, not the command.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

# Wider than any report's widest table, so none is cut when the output is not a terminal.
UNBOUNDED_WIDTH = 240


class _ReportConsole(Console):
    def on_broken_pipe(self) -> None:
        # The reader of stdout left (``| head``): the rest of the report goes nowhere and
        # the command goes on to write its files, where Rich would exit at once.
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def report_console() -> Console:
    """The stdout console a report prints to."""
    console = _ReportConsole()
    if not console.is_terminal:
        console = _ReportConsole(width=UNBOUNDED_WIDTH)
    return console
