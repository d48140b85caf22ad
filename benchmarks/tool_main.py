"""How every benchmark script ends: with its main's status, or on Ctrl-C with one line.

Ctrl-C raises ``KeyboardInterrupt`` (``asyncio.run`` first cancels its main task, and raises
it once that task has ended), and the context managers it unwinds stop the servers and other
processes the script started; ``replystream.lab.local_server.owned_child`` keeps a terminal's
Ctrl-C, sent to its whole foreground process group, from reaching them too. What is left of
it is for the operator: ``NAME: interrupted`` and exit status 130, as a shell reports a
command Ctrl-C stopped, where Python printed a traceback of whatever line the script was at
and ended by SIGINT.

Each script ends ``tool_main(main)``; those under a folder (``delivery/``, ``relay/``,
``soak/``) put this folder on ``sys.path`` first, as for their other shared modules.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

INTERRUPTED_EXIT = 130  # 128 + SIGINT


def tool_main(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` and exit with its status (None: 0); on Ctrl-C, once what it started has
    been stopped, say so in one line and exit 130."""
    try:
        status = main()
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: interrupted", file=sys.stderr)
        status = INTERRUPTED_EXIT
    sys.exit(status)
