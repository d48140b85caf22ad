"""``HFEngineConfig``: the Hugging Face engine's settings, and the check of its model folder,
apart from the engine so that reading them (``replystream serve --help``, the settings
reference) and a wrong path (told before a missing torch) need neither torch nor
transformers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replystream.engine.lfs_pointer import lfs_pointer_words

GENERATION_CONFIG = "generation_config.json"


def check_model_folder(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` is a folder a Hugging Face model may be in, none of
    its files a Git LFS pointer (a clone without Git LFS), its ``generation_config.json`` (if
    any) readable JSON with usable end ids."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model folder (no config.json)")
    for file in sorted(path.iterdir()):
        pointer = lfs_pointer_words(file)
        if pointer is not None:
            raise ValueError(f"{file}: {pointer}")
    check_generation_config(path / GENERATION_CONFIG)


def check_generation_config(file: Path) -> None:
    """A folder's ``generation_config.json``, when there is one, is a JSON object whose
    ``eos_token_id`` (where the reply ends) is a token id or a list of them.

    ``transformers`` takes a file that is not JSON as no file (a note at its info level) and
    keeps a wrong-typed ``eos_token_id``: a reply would end at config.json's ids instead, or at
    none (Llama 3's instruct models end their turns at an id only this file lists).

    Raises:
        ValueError: naming the file and what is wrong.
    """
    if not file.exists():
        return
    try:
        data: Any = json.loads(file.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{file}: nested too deeply to read") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{file}: not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise ValueError(f"{file}: eos_token_id is {eos!r}; it must be a token id or a list of ids")


@dataclass(frozen=True, slots=True)
class HFEngineConfig:
    """How many replies run at once, and a reply's length and seed when a request sets none."""

    max_running: int = 4
    default_max_tokens: int = 128
    torch_threads: int | None = 1  # per process; None leaves torch's own choice
    seed: int | None = None  # a request without a seed samples with it (None: a fresh one each)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.default_max_tokens < 1:
            raise ValueError("max_running and default_max_tokens must be at least 1")
