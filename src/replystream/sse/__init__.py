"""Server-sent events, sans-IO: `Event` values, an encoder to bytes and a parser from bytes.

This package decides the event-stream wire format and nothing else: no sockets, no clocks.
"""

from replystream.sse.encoder import encode, encode_comment, encode_data
from replystream.sse.events import Event, EventTooLarge, SSEError
from replystream.sse.parser import EventParser

__all__ = [
    "Event",
    "EventParser",
    "EventTooLarge",
    "SSEError",
    "encode",
    "encode_comment",
    "encode_data",
]
