"""A reload signal (SIGHUP) while ``serve`` starts, remembered until it serves.

``serve`` reads its files (the API keys, a relay's routes) early in its start, then loads the
engine and listens: seconds, with a model. An operator who edits a file then and sends SIGHUP
(``systemctl reload`` right after a start) means the edit to be served; ignored, the signal
was lost and the file as read before the edit was served until the next one (a revoked key
let in). So while it starts, a SIGHUP is only remembered (it must not stop the start either),
and ``serve_forever`` reads the files once more as soon as it serves (``came``). With
``--workers``, the parent does the same for each worker (``workers``). This file must not know
about HTTP or the engine.
"""

from __future__ import annotations

import signal
from types import FrameType

_received = False


def remember() -> None:
    """Remember SIGHUP from now on, instead of what it would do (stop the process)."""
    signal.signal(signal.SIGHUP, _on_sighup)


def _on_sighup(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True


def came() -> bool:
    """Whether a SIGHUP came since ``remember`` or the last ``came`` (which forgets it)."""
    global _received
    received, _received = _received, False
    return received
