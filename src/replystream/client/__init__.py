"""Clients that see only the wire format: timed reads of replies."""

from replystream.client.measure import ReplyTiming, measure_reply

__all__ = ["ReplyTiming", "measure_reply"]
