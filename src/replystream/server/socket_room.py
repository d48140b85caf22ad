"""How much a client connection's socket takes without a write having to wait: the rule
every frame transport shares (``sse_transport``, ``ws_transport``).

aiohttp's writes wait only while its protocol is paused (the socket's buffer passed its
high-water mark), so a write that keeps the buffer below the mark cannot wait, and needs no
deadline; the direct path writes only while the buffer is below it. And how a socket whose
last bytes may never leave (a client that stopped reading) is dropped after a grace. It must
not know about framing.
"""

from __future__ import annotations

import asyncio

from aiohttp.base_protocol import BaseProtocol

WRITE_OVERHEAD = 8 * 1024  # room for what a write may add: headers, chunk or frame headers
LAST_WORDS_S = 5.0  # how long a cut socket's final bytes (an event, a close frame) may take


class SocketRoom:
    """A transport's view of its socket's buffer (a base class: no object of its own)."""

    __slots__ = ("_high_water", "_protocol", "_transport")

    def __init__(self, transport: asyncio.Transport | None, protocol: BaseProtocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._high_water = 0 if transport is None else transport.get_write_buffer_limits()[1]

    def takes_at_once(self, size: int) -> bool:
        """Whether ``size`` more bytes leave without the write having to wait."""
        transport = self._transport
        return (
            transport is not None
            and not self._protocol.writing_paused
            and transport.get_write_buffer_size() + size + WRITE_OVERHEAD <= self._high_water
        )

    def has_room(self) -> bool:
        """Whether the socket is open and below its high-water mark (the direct path)."""
        transport = self._transport
        return (
            transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() < self._high_water
        )


def unacknowledged_limit_s(slow_client_s: float) -> float:
    """How long bytes sent to a client may wait for its acknowledgement before the kernel
    drops the connection (``TCP_USER_TIMEOUT``): a peer gone without a FIN or a reset (a
    phone in a tunnel, a host switched off) acknowledges nothing, and the server's own
    limits cannot see it while the kernel's buffer still takes what it is sent (a reply at
    a few tokens a second fills it in minutes, keep-alive comments never). As long as a
    slow client is given, and its last words after: a client that stopped reading answers
    the kernel's probes, but Linux counts a window kept shut that long too, and must not cut
    it before the server's own limit does, with its ``slow_client`` event."""
    return slow_client_s + LAST_WORDS_S


def abort_later(transport: asyncio.WriteTransport, delay_s: float) -> None:
    """Abort ``transport`` in ``delay_s`` unless it is gone by then (its last bytes left)."""
    asyncio.get_running_loop().call_later(delay_s, _abort_unless_gone, transport)


def _abort_unless_gone(transport: asyncio.WriteTransport) -> None:
    # asyncio's socket transport, closed and then drained, lets go of its protocol and loop
    # without counting itself lost: aborting it then fails inside the loop's callback.
    if transport.get_protocol() is not None:
        transport.abort()
