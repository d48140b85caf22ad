"""``HFEngineConfig``: the Hugging Face engine's settings, and the check of its model folder,
apart from the engine so that reading them (``replystream serve --help``, the settings
reference) and a wrong path (told before a missing torch) need neither torch nor
transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def check_model_folder(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` is a folder a Hugging Face model may be in."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model folder (no config.json)")


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
