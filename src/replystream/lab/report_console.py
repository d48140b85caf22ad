"""Where the lab's reports are printed: a console as wide as its output allows.

A terminal keeps its own width (its user chose it). Anything else (a pipe, a file, a CI log)
has no width, and Rich would assume 80 columns and cut or wrap the tables; there the console
is as wide as any report needs, so a table reads the same in a log as on a screen.
"""

from __future__ import annotations

from rich.console import Console

# Wider than any report's widest table, so none is cut when the output is not a terminal.
UNBOUNDED_WIDTH = 240


def report_console() -> Console:
    """The stdout console a report prints to."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=UNBOUNDED_WIDTH)
    return console
