"""How much a client connection's socket takes without a write having to wait: the rule
every frame transport shares (``sse_transport``, ``ws_transport``).

aiohttp's writes wait only while its protocol is paused (the socket's buffer passed its
high-water mark), so a write that keeps the buffer below the mark cannot wait, and needs no
deadline; the direct path writes only while the buffer is below it. It must not know about
framing.
"""

from __future__ import annotations

import asyncio

from aiohttp.base_protocol import BaseProtocol

WRITE_OVERHEAD = 8 * 1024  # room for what a write may add: headers, chunk or frame headers


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
