"""The HTTP server: routes, error shape and the serving loop.

Its names are imported on first use, so a module that needs one part of the server (a
schema's limits, a setting's config) does not load all of it: a command line's mistake is
reported before the app is.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replystream.server.app import create_app
    from replystream.server.serve import RunningServer, running, serve_forever, serving

__all__ = ["RunningServer", "create_app", "running", "serve_forever", "serving"]

_HOMES = {
    "create_app": "replystream.server.app",
    "RunningServer": "replystream.server.serve",
    "running": "replystream.server.serve",
    "serve_forever": "replystream.server.serve",
    "serving": "replystream.server.serve",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
