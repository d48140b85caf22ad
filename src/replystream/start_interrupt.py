"""A Ctrl-C while ``serve`` starts, remembered so that no library can swallow it.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread is. While the
server loads (its imports, the engine), that can be inside code that catches and drops it:
C code that clears any error it meets, a module's own import machinery. The interrupt is then
lost, and the server goes on to listen and serve as if nobody had pressed Ctrl-C (seen under
load, about one start in a few hundred interrupted). So the default handler is replaced for
the start by one that also remembers the signal, and ``serve_forever`` asks, once its own
handlers have taken SIGINT over, whether one came (``interrupted``).

Raised inside a callback whose errors Python cannot pass on (a weakref's, such as those of
the import machinery's module locks; a ``__del__``), the interrupt is dropped and Python
prints "Exception ignored" with its traceback. That is one more way of swallowing it, which
the memory above already answers: such a report of our own interrupt is left unprinted.
Raising from the handler stays, so a Ctrl-C still stops a long load (an engine's) at once
wherever it lands but there. This file must not know about HTTP or the engine.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

_received = False


def remember() -> None:
    """Remember SIGINT from now on, still raising ``KeyboardInterrupt`` as Python does; left
    alone where SIGINT is not Python's default (a worker, started deaf to it, must stay so)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    signal.signal(signal.SIGINT, _on_sigint)
    report = sys.unraisablehook

    def unraisable(dropped: sys.UnraisableHookArgs) -> None:
        if not (_received and issubclass(dropped.exc_type, KeyboardInterrupt)):
            report(dropped)  # not ours: as Python reports it

    sys.unraisablehook = unraisable


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether a SIGINT came since ``remember``."""
    return _received
