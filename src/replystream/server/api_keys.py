"""The API keys a server is started with: from ``--api-key`` flags and ``--api-keys-file``.

This file decides what a key may be (one word a client can send in a header) and how a keys
file is read; ``server.auth`` decides what a request must offer. Apart from it (which needs
aiohttp) so that a wrong key or file is told before the server loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from replystream.server.text_files import read_text_file


def read_keys_file(path: Path) -> list[str]:
    """API keys from a file: one per line; blank lines and lines starting with ``#`` skipped.

    Raises:
        ValueError: naming the file: it cannot be read, is not UTF-8 text, or holds no key
            (auth would silently be off otherwise).
    """
    text = read_text_file(path)
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(f"{path}: line {number}: {problem}")
        keys.append(key)
    if not keys:
        raise ValueError(f"{path}: no API keys in the file")
    return keys


def key_problem(key: str) -> str | None:
    """Why ``key`` could never be sent as one, or None. A client sends a key in a header
    (``Bearer <key>``, ``x-api-key``): one token of visible ASCII. A key with a space in it
    (two keys on a line, a comment after one) would be configured and never match."""
    if all("!" <= char <= "~" for char in key):
        return None
    bad = next(char for char in key if not "!" <= char <= "~")
    return f"a key is one word of visible ASCII characters; this one has {bad!r}"


def collect_keys(flags: Sequence[str], path: Path | None) -> list[str]:
    """The keys given as ``--api-key`` flags and in ``--api-keys-file`` (none: auth off).

    Raises:
        ValueError: naming the flag: a flag is empty, or the file cannot be read or holds no
            key (read again on SIGHUP, the file is not checked while parsing).
    """
    keys = [key.strip() for key in flags]
    if any(not key for key in keys):
        raise ValueError("--api-key must not be empty")
    for key in keys:
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(f"--api-key: {problem}")
    if path is not None:
        try:
            keys += read_keys_file(path)
        except ValueError as exc:
            raise ValueError(f"--api-keys-file {exc}") from None
    return keys
