"""Room for the connections a run holds at once, in this process's open-file limit.

Each connection a measuring command holds is a socket, and a socket past the open-file limit
(``ulimit -n``, often 1,024) can only fail. The soft limit is raised as far as the run needs
when the hard one allows it, as load tools do; past the hard one, the run is refused before
it starts. This file must not know what the connections are for.
"""

from __future__ import annotations

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
