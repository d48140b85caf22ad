"""Whether a model's file is a Git LFS pointer rather than the file itself.

A model repository cloned without Git LFS installed (``git clone`` of a Hugging Face
repository, say) holds, in place of each large file (weights, a GGUF, often the tokenizer), a
pointer of about 130 bytes naming the file's hash and size. Read as the file it stands for, it
was refused in the reader's words ("no GGUF magic", safetensors' "header too large", JSON's
"Expecting value"), which said nothing of the cause. This file tells a pointer by its first
line, as Git LFS writes it. It must not know how any model file is read.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

_FIRST_LINE = b"version https://git-lfs.github.com/spec/"
_LARGEST = 1024  # Git LFS never writes a pointer larger than this
_SIZE = re.compile(rb"^size (\d+)$", re.MULTILINE)


def lfs_pointer_words(path: Path) -> str | None:
    """What is wrong with ``path`` when it is a Git LFS pointer, in the words of a refusal;
    None when it is not one (or cannot be read: its reader says why)."""
    try:
        status = path.stat()
        if not stat.S_ISREG(status.st_mode) or status.st_size > _LARGEST:
            return None  # a pipe is never opened here: its open would wait for a writer
        head = path.read_bytes()[:_LARGEST]
    except OSError:
        return None
    if not head.startswith(_FIRST_LINE):
        return None
    size = _SIZE.search(head)
    of = f" of {int(size.group(1)):,} bytes" if size else ""
    return f"a Git LFS pointer, not the file{of} it stands for: fetch that file (git lfs pull)"
