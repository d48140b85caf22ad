"""The files of lines ``serve`` reads at start and again on SIGHUP (``server.reload``): the
API keys (``--api-keys-file``) and the banned phrases (``--ban-file``).

This file decides how such a file is read, and what is said of one that cannot be: it must be
a regular file (a pipe would be read until a writer closes it, a reload's wait stopping the
server; a device for ever), in UTF-8, a byte-order mark at its start no part of its first
line. What its lines mean is its reader's. Apart from the server (no aiohttp) so that a
mistake is told before the server loads.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from pathlib import Path


def read_text_file(path: Path) -> str:
    """The text of ``path``.

    Raises:
        ValueError: naming the file: it is not a regular file, cannot be read, or is not
            UTF-8 text.
    """
    try:
        mode = path.stat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder: its read says so
            raise ValueError(f"{path}: is not a regular file (a pipe, a device): want the file")
        # Without the byte-order mark some Windows editors write at the start of a UTF-8
        # file: it is no part of the first line (a key would be refused for it).
        return path.read_text(encoding="utf-8").removeprefix("\ufeff")
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        why = f"byte 0x{byte:02x} at offset {exc.start}: {exc.reason}"
        raise ValueError(f"{path}: not UTF-8 text ({why})") from None


def banned_phrases(flags: Sequence[str], path: Path | None) -> list[str]:
    """The phrases given as ``--ban`` flags and in ``--ban-file`` (one per line, blank lines
    skipped; none: no phrase is banned).

    Raises:
        ValueError: naming the flag: the file cannot be read, or holds no phrase (moderation
            would silently be off).
    """
    phrases = list(flags)
    if path is not None:
        try:
            listed = [line.strip() for line in read_text_file(path).splitlines()]
        except ValueError as exc:
            raise ValueError(f"--ban-file {exc}") from None
        if not any(listed):
            raise ValueError(f"--ban-file {path}: no phrase in it (every line is blank)")
        phrases += [phrase for phrase in listed if phrase]
    return phrases
