"""Result files written whole or not at all.

A file is written under a hidden name beside its path and renamed onto it only once complete,
so a Ctrl-C (or a full disk) while it is written never leaves a truncated JSON or CSV that
reads as a whole one, nor clears the file an earlier run left there. This file must not know
what the files hold.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def written_whole(path: Path, newline: str | None = None) -> Iterator[TextIO]:
    """A text file to write ``path``'s content into; ``path`` gets it only if the block ends
    without an error (a ``KeyboardInterrupt`` too), and the partial file is removed if not.

    What is no regular file (``/dev/stdout``, a pipe), or sits in a folder this user may not
    add a file to, is written in place, as nothing else can be.
    """
    target = Path(os.path.realpath(path))  # through a link, as writing in place would go
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    file = _opened(part, newline) if target.is_file() or not target.exists() else None
    if file is None:
        with path.open("w", newline=newline, encoding="utf-8") as in_place:
            yield in_place
        return
    try:
        with file:
            yield file
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise


def _opened(part: Path, newline: str | None) -> TextIO | None:
    try:
        return part.open("x", newline=newline, encoding="utf-8")
    except OSError:  # a folder this user may not add to, holding a file it may rewrite
        return None


def write_text_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole, or leave ``path`` as it was."""
    with written_whole(path) as file:
        file.write(text)
