"""One client connection as a follower writes to it, in the connection's own framing: the seam
between a follower (``follower``) and each transport (SSE over HTTP/1.1, a WebSocket).

This file names what a transport must do for a follower (``FrameTransport``) and how a
follower may end (``Ending``), which it tells its transport. It decides nothing and does no
I/O; the framing is each transport's, the follow loop and its limits the follower's. It must
not know about HTTP, WebSockets, the engine or which store keeps the log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from replystream.delivery.replay import LogEntry

Ending = Literal[
    "ended",
    "client_gone",
    "slow_client",
    "shutdown",
    "producer_lost",
    "expired",
    "deleted",
    "evicted",
    "store_unavailable",
    "events_lost",
    "failed",
]


class FrameTransport(Protocol):
    """One client connection as a follower writes to it, in the connection's own framing."""

    def encode(self, entries: Sequence[LogEntry]) -> bytes:
        """The wire bytes of log entries (SSE events, WebSocket messages), asked for only
        to write them at once."""
        ...

    def notice(self, event: str, data: str, after: int) -> bytes:
        """The wire bytes of an unnumbered event the follower decides on (``error``,
        ``gap``) after event ``after``: never in the log, so a resume neither repeats nor
        misses one."""
        ...

    def tells_gaps(self) -> bool:
        """Whether the stream can say that events are lost and go on (a ``gap`` notice);
        else the follower ends it with an ``events_lost`` error at a gap, as a dialect must
        whose clients read one text and would take a text with a hole for the whole."""
        ...

    def keepalive(self, *, first: bool) -> bytes | None:
        """What an idle stream sends to stay open (None: the transport keeps itself alive).
        ``first``: none of the stream's events was sent yet."""
        ...

    async def open(self, *, with_first_events: bool) -> None:
        """Begin the response (headers). ``with_first_events``: events are ready, and may
        leave in the same write as the headers."""
        ...

    def takes_at_once(self, size: int) -> bool:
        """Whether ``size`` more bytes leave without the write having to wait."""
        ...

    def has_room(self) -> bool:
        """Whether the socket is open and below its high-water mark (the direct path)."""
        ...

    async def write(self, data: bytes, *, last: bool) -> int:
        """Write ``data``, waiting for the socket to drain; ``last``: the stream ends with it.
        Returns the bytes that went on the wire. Raises ``ConnectionError``."""
        ...

    def push(self, entries: Sequence[LogEntry]) -> int | None:
        """The direct path: encode and write entries without waiting, if the socket has room;
        the bytes that went on the wire, or None (nothing written: the follower must wait)."""
        ...

    async def end(self) -> None:
        """End the stream properly (its terminal framing), if not ended by a last write."""
        ...

    def last_words(self, notice: bytes, ending: Ending) -> int:
        """The follower was cut (``ending``): queue a final notice without waiting, and close
        what the cut closes; give up on it if it cannot leave soon (the client is not
        reading). Returns the notice's bytes as ``write`` counts them, 0 if it could not be
        queued (the connection is closing, or the stream had ended)."""
        ...

    def finished(self, ending: Ending) -> None:
        """The follower is done (its transport's last bookkeeping)."""
        ...
