"""A ``Retry-After`` header read (RFC 9110, section 10.2.3): how long a peer asks us to wait.

This file decides what a header value means: ``delay-seconds`` (ASCII digits only) or an
``HTTP-date`` (IMF-fixdate, and the obsolete RFC 850 and asctime forms every recipient must
read, section 5.6.7), as seconds from now, at most the caller's bound. Anything else (a sign,
a fraction, words, a date that is no date, a date already past) asks for nothing, as if the
header were absent. The wall clock is passed in; nothing here reads one. It must not know
what the wait is for: the relay reads an upstream's refusal with it, the resuming reader a
server's.
"""

from __future__ import annotations

from datetime import UTC
from email.utils import parsedate_to_datetime


def retry_after_s(value: str, now: float, limit_s: float) -> float | None:
    """Seconds ``value`` asks to wait from ``now`` (wall-clock seconds since the epoch, what
    an HTTP-date is read against), at most ``limit_s``; None when it asks for no wait."""
    value = value.strip()
    if value.isascii() and value.isdigit():
        # Past the bound's digits the number only says "longer than the bound" (and int()
        # of a few thousand digits raises).
        seconds = float(value) if len(value) <= 15 else limit_s
    else:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:  # asctime's form names no zone: every HTTP-date is in GMT
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - now
    return min(seconds, limit_s) if seconds > 0 else None
