"""Room for the connections a run holds at once, in this process's open-file limit.

Each connection a measuring command holds is a socket, and a socket past the open-file limit
(``ulimit -n``, often 1,024) can only fail. The soft limit is raised as far as the run needs
when the hard one allows it, as load tools do; past the hard one, the run is refused before
it starts. This file must not know what the connections are for.
"""

from __future__ import annotations

import contextlib
import resource

# Files the process keeps open besides its requests' connections (standard streams, the event
# loop's own, a scrape, the outputs): the requests at once leave room for them.
OWN_FILES = 32


def make_room(at_once: int) -> int | None:
    """Raise the soft limit to hold ``at_once`` connections; None when it does, else the hard
    limit that cannot hold them (so the caller can say so, naming its flag)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or at_once <= soft - OWN_FILES:
        return None
    if hard == resource.RLIM_INFINITY or at_once <= hard - OWN_FILES:
        resource.setrlimit(resource.RLIMIT_NOFILE, (at_once + OWN_FILES, hard))
        return None
    return int(hard)


def make_room_for_up_to(most: int) -> None:
    """Raise the soft limit toward holding ``most`` connections, as far as the hard limit
    allows, refusing nothing: an open loop sends at its own times, so it may hold every
    request at once against a slow server, or only a few."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = most + OWN_FILES
    if soft == resource.RLIM_INFINITY or wanted <= soft:
        return
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    # Not raised (a system cap below the hard limit): the run goes on with the room it has.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
