"""The bytecode of the replystream a benchmark serves, written before its servers start.

A server that finds no current ``.pyc`` beside a module compiles it as it imports it, and
keeps none when ``PYTHONDONTWRITEBYTECODE`` is set (as on some machines). What compiling
freed stays in the process's allocator, and a run's streams then fill it without growing the
resident size: in the relay benchmark at C = 100 the same code showed 23 KiB per stream so
started and 30 KiB with its bytecode written, as ``pip install`` writes it (in the delivery
benchmark at C = 1,000, 15.2 and 16.0 KiB). Written here first, every server starts as an
installed one does, and memory per stream is what streams cost.
"""

from __future__ import annotations

import compileall
from pathlib import Path

import replystream


def write_bytecode() -> None:
    """Compile the replystream this process imports (the one its servers run: the same
    ``PYTHONPATH``), writing each module's ``.pyc`` whatever the environment says."""
    compileall.compile_dir(Path(replystream.__file__).parent, quiet=1)
