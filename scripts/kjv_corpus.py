"""Build the training corpus: the King James Bible as plain prose, from Debian's bible-kjv.

The text ships in the Debian packages ``bible-kjv`` (the ``bible`` program) and
``bible-kjv-text`` (the data); the 1611 translation is out of copyright. This file decides how
verses become prose (verse references dropped, one paragraph per chapter); it must not know
about tokenizers or models.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

_REFERENCE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def ensure_bible_program() -> str:
    """Path of the ``bible`` program, installing Debian's ``bible-kjv`` as root if missing."""
    found = shutil.which("bible")
    if found is None:
        subprocess.run(["apt-get", "update", "-q"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "bible-kjv"], check=True)
        found = shutil.which("bible")
    if found is None:
        raise SystemExit("the `bible` program (Debian package bible-kjv) is required")
    return found


def kjv_prose() -> str:
    """The whole King James Bible, one paragraph per chapter, separated by blank lines."""
    raw = subprocess.run(
        [ensure_bible_program(), "-f", "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    paragraphs: list[str] = []
    verses: list[str] = []
    chapter: tuple[str, str] | None = None
    for line in raw.splitlines():
        match = _REFERENCE.match(line.strip())
        if match is None:
            continue
        book, number, _verse, text = match.groups()
        if (book, number) != chapter and verses:
            paragraphs.append(" ".join(verses))
            verses = []
        chapter = (book, number)
        verses.append(text.strip())
    if verses:
        paragraphs.append(" ".join(verses))
    return "\n\n".join(paragraphs) + "\n"


def write_corpus(path: Path) -> Path:
    """Write the corpus to ``path`` (UTF-8) and return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kjv_prose(), encoding="utf-8")
    return path
