"""``replystream serve``, with the CPU time of one layer of a relayed chunk's way summed.

Run by ``layer_cost.py`` as ``python layer_probe.py OUT LAYER serve ARGS...``: the server runs
as the CLI runs it, with the one function of ``LAYERS[LAYER]`` wrapped to add the thread's CPU
time spent in each call (``time.thread_time_ns``) and count the calls. On SIGUSR1 the sums
so far go to ``OUT`` (JSON ``{"ns": ..., "calls": ...}``, renamed into place once whole).
One layer a run: a wrapper costs two clock reads (system calls) a call, which a wrapper
outside it would count as its own. Names of private replystream functions are wrapped here:
if one is gone, this fails at start, loudly.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from replystream import cli
from replystream.delivery import follower
from replystream.engine import upstream_chunks, upstream_http_connection, upstream_relay
from replystream.server import replies, sse_transport

# Each layer a relayed chunk passes through, outermost first: what its time includes.
LAYERS: dict[str, tuple[Any, str]] = {
    # the upstream socket read handed over: framing, then all the rest of this table
    "read": (upstream_http_connection.Connection, "data_received"),
    # the body bytes parsed into deltas (SSE events, their JSON, the chunk's checks)
    "parse": (upstream_chunks.ChunkReader, "_take"),
    # the relayed reply's checks (stop strings, token limit, the watchdog), and on
    "relay": (upstream_relay.RelayedReply, "on_deltas"),
    # the reply: its pipeline, the format's encoding, its log and metrics, and on
    "reply": (replies.Reply, "on_deltas"),
    # the reader writing what the reply logged, and on
    "follower": (follower.Follower, "push"),
    # the SSE transport's checks and the write (the send system call)
    "write": (sse_transport.SSETransport, "push"),
}


def main() -> None:
    out, layer = Path(sys.argv[1]), sys.argv[2]
    owner, name = LAYERS[layer]
    original = getattr(owner, name)
    total = [0, 0]  # CPU ns, calls
    clock = time.thread_time_ns

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = clock()
        try:
            return original(*args, **kwargs)
        finally:
            total[0] += clock() - began
            total[1] += 1

    setattr(owner, name, timed)

    def dump(*_: object) -> None:
        partial = out.with_suffix(".partial")
        partial.write_text(json.dumps({"ns": total[0], "calls": total[1]}))
        os.replace(partial, out)

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["replystream", *sys.argv[3:]]
    cli.main()


if __name__ == "__main__":
    main()
