"""Stop strings: where the first one completes in text that arrives in pieces, and how much
of the newest text could still be the start of one.

The reply ends at the first stop string to *complete* (the earliest end; of two ending at the
same character, the longer), cut before its first character. Any other rule would depend on
how the text happened to be split into tokens: with stops ``"abc"`` and ``"b"``, a stream that
has seen ``"ab"`` must already decide, so the text ``"abc"`` ends at ``"a"`` whole or in
pieces. ``StopScan`` is pure and scans only what is new (plus the few characters before it a
stop could start in), so a long reply costs the same per piece as a short one. It must not
know about tokens, events or time. ``delivery.moderation.HoldBack`` uses it to decide what it
withholds and where a reply ends; an engine uses it to stop making tokens early
(``engine.sampling.StopMatcher``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopHit(NamedTuple):
    """A stop string that completed: where it starts in all text seen, and which one."""

    start: int
    stop: str


class StopScan:
    """Watches text piece by piece for the first stop string to complete."""

    __slots__ = ("_span", "_stops", "_tail", "keep", "seen")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("StopScan needs at least one stop string, none empty")
        self._stops = tuple(dict.fromkeys(stops))
        # A stop string can start at most this many characters before the newest piece.
        self._span = max(len(stop) for stop in self._stops) - 1
        self._tail = ""  # the last ``_span`` characters seen
        self.seen = 0  # characters seen so far
        self.keep = 0  # how many of the newest characters could begin a stop string

    def break_text(self) -> None:
        """The text seen so far ended (a tool call came between): no stop string begun in
        it can complete in what comes next."""
        self._tail = ""
        self.keep = 0

    def feed(self, text: str) -> StopHit | None:
        """Scan a new piece; the first stop string it completes, if any. Otherwise ``keep``
        says how much of the text seen so far must be withheld (the shortest tail holding
        every place a stop string could still begin)."""
        window = self._tail + text
        offset = self.seen - len(self._tail)  # where ``window`` starts in all text seen
        self.seen += len(text)
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            # Nothing completed before this piece, so the earliest occurrence in the window
            # ends in the new text; for one string the earliest start is the earliest end.
            index = window.find(stop)
            if index >= 0:
                candidate = (index + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            end, negative_length, stop = best
            return StopHit(offset + end + negative_length, stop)
        self._tail = window[-self._span :] if self._span else ""
        # A stop string begun ``n`` characters before the end of the window had begun
        # ``n - len(text)`` before the end of the text seen before, so it is at most the last
        # ``keep`` plus this piece: only those need trying. Trying every length up to the
        # longest stop string's, each comparison as long as its length, cost a piece the
        # square of that length (a stop string of 40,000 characters: about 20 ms a token).
        longest = self.keep + len(text)
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(window), longest), keep, -1):
                if window.endswith(stop[:n]):
                    keep = n
                    break
        self.keep = keep
        return None


def cut_at_first_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """The text before the first stop string to complete, and that string (None: no stop).

    The whole-text rule ``StopScan`` follows piece by piece; tests compare the two.
    """
    best: tuple[int, int, str] | None = None
    for stop in dict.fromkeys(stops):
        index = text.find(stop)
        if index >= 0 and (best is None or (index + len(stop), -len(stop)) < best[:2]):
            best = (index + len(stop), -len(stop), stop)
    if best is None:
        return text, None
    end, negative_length, stop = best
    return text[: end + negative_length], stop
