"""Clients that see only the wire format: timed reads of replies."""

from replystream.client.measure import ReplyTiming, measure_reply
from replystream.client.resume import Backoff, ResumeFailed, ResumingReader

__all__ = ["Backoff", "ReplyTiming", "ResumeFailed", "ResumingReader", "measure_reply"]
